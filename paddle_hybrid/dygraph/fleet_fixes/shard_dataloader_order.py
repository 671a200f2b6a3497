"""``dist.shard_dataloader`` and ``paddle.io.DataLoader`` in auto-DP mode keep the order of the
batch sampler they are given.

Paddle 3.2.2 and 3.3.1, two places alike: ``ShardDataloader`` (``auto_parallel/api.py``),
splitting a loader along a data-parallel mesh dimension, and ``DataLoader.__init__``
(``io/reader.py``) while auto-parallel's DP mode is on, replace a batch sampler that is not a
``DistributedBatchSampler`` by a new ``DistributedBatchSampler`` over the dataset, reading only
the old one's ``shuffle`` attribute.  A batch sampler whose order comes from its own sampler
(``shuffle`` is then False) or its own ``__iter__`` loses that order silently, on every device:
the ranks read the dataset in index order.  PaddleFormers' Trainer with ``--enable_auto_parallel 1`` hands it such a sampler
(its seeded shuffle, which also skips the samples a resumed run consumed), so its data-parallel
run trained on other samples than the same run in one process or under fleet: step 1 loss
5.160 where both give 5.191 (tiny LLaMA, DP2; the DataLoader's replacement, made while the
Trainer builds its loader, is the one that acted there).

Patch (both places): when Paddle replaced a batch sampler of another order (a subclass of
``BatchSampler``, or a sampler other than Paddle's sequential or random one), the rank reads what
Paddle's replacement would (the same batch size, accumulation steps, padding, length), but over
the indices the given sampler yields, in its order: global batches cut from that stream, rank
``r`` of ``n`` taking part ``r`` of each, as the replacement does with the dataset's order.
Plain samplers keep Paddle's behaviour.
"""
from __future__ import annotations

import functools

__all__ = ["GivenOrderPart", "apply", "keeps_own_order"]


def keeps_own_order(batch_sampler) -> bool:
    """Whether ``batch_sampler`` orders its indices in a way Paddle's replacement would not
    reproduce (its class, or its sampler, is not one of Paddle's plain ones)."""
    import paddle

    if isinstance(batch_sampler, paddle.io.DistributedBatchSampler):
        return False
    if type(batch_sampler) is not paddle.io.BatchSampler:
        return True
    sampler = getattr(batch_sampler, "sampler", None)
    return type(sampler) not in (paddle.io.SequenceSampler, paddle.io.RandomSampler)


class GivenOrderPart:
    """What Paddle's ``DistributedBatchSampler`` replacement ``replaced`` yields on this rank (its
    batch size, ``_acc_steps``, padding and length), over the index order of ``given`` instead of
    the dataset's: the indices ``given`` yields, one after another, cut into global batches of
    ``nranks`` parts, this rank taking part ``rank`` of each."""

    def __init__(self, given, replaced):
        self.given = given
        self.rank, self.nranks = replaced.local_rank, replaced.nranks
        self.batch_size, self._acc_steps = replaced.batch_size, getattr(replaced, "_acc_steps", 1)
        self.drop_last, self.shuffle = replaced.drop_last, getattr(replaced, "shuffle", False)
        self.num_samples = replaced.num_samples

    def set_epoch(self, *args, **kwargs):
        if hasattr(self.given, "set_epoch"):
            self.given.set_epoch(*args, **kwargs)

    def _part(self, chunk: list) -> list:
        size = len(chunk) // self.nranks
        return chunk[self.rank * size:(self.rank + 1) * size]

    def __iter__(self):
        local = self.batch_size * self._acc_steps
        whole = local * self.nranks
        pending, first = [], []
        for batch in self.given:
            pending.extend(batch)
            if len(first) < self.nranks:
                first.extend(batch[:self.nranks - len(first)])
            while len(pending) >= whole:
                yield self._part(pending[:whole])
                del pending[:whole]
        if pending and not self.drop_last:
            # As Paddle's sampler: pad with the first indices until every rank gets as many.
            pending += (first * self.nranks)[:(-len(pending)) % self.nranks]
            yield self._part(pending)

    def __len__(self) -> int:  # as Paddle's DistributedBatchSampler counts
        local = self.batch_size * self._acc_steps
        return (self.num_samples + int(not self.drop_last) * (local - 1)) // local


def _loader_like(dataloader, batch_sampler):
    """A ``DataLoader`` as Paddle's ``ShardDataloader`` makes one, over ``batch_sampler``."""
    import paddle

    return paddle.io.DataLoader(
        dataset=dataloader.dataset, batch_sampler=batch_sampler, feed_list=dataloader.feed_list,
        places=dataloader.places, return_list=dataloader.return_list, collate_fn=dataloader.collate_fn,
        num_workers=dataloader.num_workers, use_buffer_reader=dataloader.use_buffer_reader,
        prefetch_factor=dataloader.prefetch_factor, use_shared_memory=dataloader.use_shared_memory,
        timeout=dataloader.timeout, worker_init_fn=dataloader.worker_init_fn,
        persistent_workers=dataloader._persistent_workers)


def _make_init(original):
    @functools.wraps(original)
    def __init__(self, dataloader, meshes, input_keys=None, shard_dims=None, is_dataset_splitted=False,
                 dense_tensor_idx=None):
        original(self, dataloader, meshes, input_keys, shard_dims, is_dataset_splitted, dense_tensor_idx)
        given = getattr(dataloader, "batch_sampler", None)
        replaced = getattr(self, "batch_sampler", None)
        if given is None or replaced is None or replaced is given or not keeps_own_order(given):
            return
        part = GivenOrderPart(given, replaced)
        self.batch_sampler = part
        self.batch_size = part.batch_size
        self._dataloader = _loader_like(dataloader, part)
        self._dataloader.pin_memory = False  # as Paddle sets it

    return __init__


def _make_loader_init(original):
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        given = signature.bind(self, *args, **kwargs).arguments.get("batch_sampler")
        replaced = getattr(self, "batch_sampler", None)
        if given is None or replaced is None or replaced is given or not keeps_own_order(given):
            return
        part = GivenOrderPart(given, replaced)
        self.batch_sampler, self.batch_size = part, part.batch_size

    return __init__


def apply(config, patcher) -> None:
    """Phases: ``DataLoader.__init__`` (auto-DP mode), then ``ShardDataloader.__init__``."""
    import inspect

    import paddle
    from paddle.distributed.auto_parallel.api import ShardDataloader
    from ...registry.patching import PatchSignatureError

    loader_init = patcher.require(paddle.io.DataLoader, "__init__", "paddle.io.DataLoader")
    if "batch_sampler" not in inspect.signature(loader_init).parameters:
        raise PatchSignatureError("fleet_fixes: paddle.io.DataLoader.__init__ takes no batch_sampler; unexpected "
                                  "Paddle. Set PADDLE_HYBRID_FLEET_FIXES=0 to run without these patches.")
    patcher.set(paddle.io.DataLoader, "__init__", _make_loader_init(loader_init))

    original = patcher.require(ShardDataloader, "__init__", "paddle.distributed.auto_parallel.api.ShardDataloader")
    patcher.check_params(original, ["self", "dataloader", "meshes", "input_keys", "shard_dims", "is_dataset_splitted",
                                    "dense_tensor_idx"], "ShardDataloader.__init__")
    patcher.set(ShardDataloader, "__init__", _make_init(original))
