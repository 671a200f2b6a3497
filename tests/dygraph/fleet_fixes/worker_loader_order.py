"""One rank: a loader whose batch sampler has an order of its own (a fixed permutation, four
samples a batch), split over 2 data-parallel ranks two ways: ``dist.shard_dataloader`` and a
``paddle.io.DataLoader`` made in auto-parallel's DP mode.  Saves the sample ids each yields, per
batch.  ``PH_TEST_STOCK_ORDER=1``: Paddle's own two methods (the fix's wrappers bypassed, every
other fix kept: ``shard_dataloader`` needs the NumPy 2 one)."""
import os

import numpy as np
import paddle
import paddle.distributed as dist

import paddle_hybrid  # noqa: F401  (installs the plugin)
from paddle_hybrid.testing import save_result

N, BATCH = 16, 4
ORDER = np.random.RandomState(0).permutation(N).tolist()


class Ids(paddle.io.Dataset):
    def __getitem__(self, i):
        return np.array([i], dtype="int64")

    def __len__(self):
        return N


class FixedOrder(paddle.io.BatchSampler):
    """Batches of ``ORDER``, as a user's or PaddleFormers' seeded sampler gives them."""

    def __init__(self):
        self.batch_size, self.drop_last, self.shuffle, self._acc_steps = BATCH, False, False, 1

    def __iter__(self):
        for start in range(0, N, BATCH):
            yield ORDER[start:start + BATCH]

    def __len__(self):
        return N // BATCH


def ids(loader):
    out = []
    for batch in loader:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        x = x._local_value() if x.is_dist() else x
        out.append(x.numpy().reshape(-1).tolist())
    return out


def use_paddles_own_methods():
    from paddle.distributed.auto_parallel.api import ShardDataloader

    for owner in (ShardDataloader, paddle.io.DataLoader):
        owner.__init__ = owner.__init__.__wrapped__.__wrapped__  # the patcher's link, the fix, Paddle's


def main():
    if os.environ.get("PH_TEST_STOCK_ORDER") == "1":
        use_paddles_own_methods()
    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    sharded = dist.shard_dataloader(paddle.io.DataLoader(Ids(), batch_sampler=FixedOrder()), meshes=[mesh],
                                    shard_dims="dp")
    from paddle.distributed.auto_parallel import auto_dp_utils

    auto_dp_utils._enable_auto_dp()
    auto_dp = paddle.io.DataLoader(Ids(), batch_sampler=FixedOrder())
    save_result({"rank": dist.get_rank(), "order": ORDER, "batch": BATCH, "shard_dataloader": ids(sharded),
                 "auto_dp_loader": ids(auto_dp), "auto_dp_len": len(auto_dp)})


if __name__ == "__main__":
    main()
