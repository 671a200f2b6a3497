"""Checkpoint loads in the fake world: the shapes the script built, no weights read.

Why: Paddle's flex-checkpoint load (``paddle.distributed.load_state_dict``, the ``dcp`` package)
is an exchange before it is a read.  Every rank tells every other which pieces of which tensors it
holds and which files it can read (``all_gather_object``), a balancer assigns each file to one
rank, that rank reads it whole and sends each rank its slices.  In a fake world a gather gives this
rank's own object in every slot (:mod:`.fake_world`), so the resharder finds every piece N times
and stops (``assert local_tensor_index not in load_infos`` in ``resharder.get_load_infos``).  It is
reached from PaddleFormers' ``from_pretrained`` (its default format: the safetensors of
``save_pretrained`` mapped by an AOA configuration) and from the Trainer's resume
(``Trainer._load_flex_checkpoint``: master weights, optimizer state, model state), so a dry run
of a pretrained model, the usual case, stopped before its first step.

What a dry run measures needs no weight: a load fills tensors the script already made, the
model's parameters and the optimizer's accumulators, at the shapes, dtypes and placements of this
rank (the model's configuration and the layout); it changes their values only, and the fake world's
values are not the real ones anyway.

What this does, in a fake world only (installed by :func:`.fake_world.apply`): ``load_state_dict``
leaves every tensor it was given as it is, makes no collective and reads no tensor data.  A target
with no memory yet (a model built under ``paddle.LazyGuard``, PaddleFormers'
``low_cpu_mem_usage=True``) gets its memory as the real load's copy would give it (its own
initializer, else zeros).  The checkpoint's directory is listed (a missing one fails as in the real
run) and the load is noted (:mod:`paddle_hybrid.common.checkpoint_record`: the directory, the
tensors and bytes of this rank it would have written, the data files on disk, their bytes and the
largest, ``weights_read: false``), which the probe records and the dry run's report says.

Not measured: the load's own memory.  A real rank reads each file assigned to it whole (on the
device unless ``offload``/``load_via_cpu``; ``paddle.load`` of safetensors puts every tensor of the
file on the GPU) and keeps temporaries for slices an AOA rule reshapes, before step 1.  Which files
a rank reads is decided from every rank's requests, so a single rank's run cannot know it; the
largest file bounds what one file read adds.  Not checked: that the checkpoint holds every tensor
the model asks for, at its shape (the real load warns of missing keys and fails on a shape
mismatch).  A plain ``paddle.load`` of a rank's own file has no exchange and reads as it does in a
real run.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys

from ..common import checkpoint_record
from ..common.tensor_bytes import nbytes

__all__ = ["apply", "DCP_LOAD", "load_entry", "targets_of"]

DCP_LOAD = "paddle.distributed.flex_checkpoint.dcp.load_state_dict"
DATA_SUFFIXES = (".distcp", ".safetensors")


def targets_of(state_dict) -> list:
    """The tensors a load would write, through nested dicts: each ``ShardedWeight``'s local tensor, each
    tensor itself (a DistTensor: it stands for its local value)."""
    found = []
    for value in state_dict.values():
        if isinstance(value, dict):
            found.extend(targets_of(value))
        elif hasattr(value, "local_tensor"):  # ShardedWeight
            found.append(value.local_tensor)
        elif hasattr(value, "_is_initialized"):
            found.append(value)
    return found


def _local(tensor):
    return tensor._local_value() if tensor.is_dist() else tensor


def _materialize(tensor) -> bool:
    """Give ``tensor`` its memory if it has none, as the real load's copy into it would (True when it had
    none).  A DistTensor is left as it is: without local memory it is on a rank outside its mesh, which the
    real load does not write either."""
    import paddle

    if tensor.is_dist() or tensor._is_initialized():
        return False
    initialize = getattr(tensor, "initialize", None)  # a parameter made under paddle.LazyGuard
    if callable(initialize):
        initialize()
    else:
        with paddle.no_grad():
            paddle.assign(paddle.zeros(tensor.shape, tensor.dtype), output=tensor)
    return True


def _files(path: str) -> list:
    """(name, bytes) of the checkpoint's data files; listing a directory that is not there fails as
    Paddle's own load does."""
    names = sorted(n for n in os.listdir(path) if n.endswith(DATA_SUFFIXES))
    return [(n, os.path.getsize(os.path.join(path, n))) for n in names]  # a link: its file's size


def _directory(path: str, files: list) -> str:
    """The directory the data files are in: a dry run's mirror of a model directory (``--compose-layers``,
    ``--measure-microbatches`` with a virtual pipeline) links to the user's files, which it names."""
    places = {os.path.dirname(os.path.realpath(os.path.join(path, name))) for name, _ in files}
    return places.pop() if len(places) == 1 else os.path.abspath(path)


def load_entry(state_dict, path: str, safetensors: bool, aoa: bool) -> dict:
    """What a load not read is noted as (see the module docstring); gives memory to targets without."""
    files = _files(path)
    tensors = targets_of(state_dict)
    materialized = sum(_materialize(t) for t in tensors)
    return {"path": _directory(path, files), "format": "safetensors" if safetensors else "distcp", "aoa": bool(aoa),
            "tensors": len(tensors), "bytes": int(sum(nbytes(_local(t)) for t in tensors)),
            "materialized": materialized,
            "files": len(files), "file_bytes": int(sum(size for _, size in files)),
            "largest_file_bytes": int(max((size for _, size in files), default=0)), "weights_read": False}


def _make_load_state_dict(stock, active):
    signature = inspect.signature(stock)

    @functools.wraps(stock)
    def load_state_dict(*args, **kwargs):
        if not active():
            return stock(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        entry = load_entry(given["state_dict"], given["path"], bool(given.get("safetensors", False)),
                           given.get("aoa_config") is not None)
        checkpoint_record.note(entry)
        print(f"[paddle_hybrid.dryrun] rank {os.environ.get('PADDLE_TRAINER_ID', '0')}: checkpoint {entry['path']} "
              f"not read (fake world): its {entry['tensors']} tensors on this rank ({entry['bytes']} bytes) keep the "
              "shapes, dtypes and placements the script built", file=sys.stderr, flush=True)
        return None

    return load_state_dict


def apply(patcher, active) -> None:
    """Replace ``load_state_dict`` in the dcp module and as ``paddle.distributed.load_state_dict``;
    ``active()``: whether this process is in a fake world (asked per call)."""
    import importlib

    import paddle.distributed as dist

    from ..registry.patching import PatchSignatureError

    module = importlib.import_module(DCP_LOAD)
    stock = patcher.require(module, "load_state_dict", DCP_LOAD)
    parameters = list(inspect.signature(stock).parameters)
    if parameters[:2] != ["state_dict", "path"]:
        raise PatchSignatureError(f"{patcher.component}: {DCP_LOAD}.load_state_dict has parameters {parameters}, "
                                  f"expected (state_dict, path, ...); unexpected Paddle. Set {patcher.off_switch} to "
                                  "run without these patches.")
    exported = patcher.require(dist, "load_state_dict", "paddle.distributed")
    replacement = _make_load_state_dict(stock, active)
    patcher.set(module, "load_state_dict", replacement)
    patcher.set(dist, "load_state_dict", replacement if exported is stock else _make_load_state_dict(exported, active))
    patcher.on_revert(checkpoint_record.clear, "the fake world's record of checkpoints not read")
