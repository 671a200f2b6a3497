"""The fake world's checkpoint load (:mod:`paddle_hybrid.gloo.fake_checkpoint`) in this process: what it leaves,
gives and notes, without a fake world (the replacement is called with ``active`` answering yes).  The dry runs
that use it: ``tests/dryrun/test_pretrained_checkpoint.py``."""
import os

import numpy as np
import paddle
import paddle.distributed as dist
import pytest
from paddle.distributed.flex_checkpoint.dcp import load_state_dict as dcp_load
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

from paddle_hybrid.common import checkpoint_record
from paddle_hybrid.gloo import fake_checkpoint


def _refuse(*args, **kwargs):
    raise AssertionError("Paddle's load was called in a fake world")


@pytest.fixture
def record():
    checkpoint_record.clear()
    yield checkpoint_record
    checkpoint_record.clear()


def test_outside_a_fake_world_paddle_loads_as_it_does():
    """Installed only in a fake world: this process (the plugin installed, no fake world) has Paddle's own."""
    assert dist.load_state_dict is dcp_load.load_state_dict
    assert not hasattr(dist.load_state_dict, "_ph_link_cell")  # no Patcher link
    calls = []
    load = fake_checkpoint._make_load_state_dict(lambda state_dict, path, **kw: calls.append(path), lambda: False)
    load({}, "somewhere")
    assert calls == ["somewhere"]


def test_the_targets_keep_their_values_and_a_lazy_one_gets_memory(tmp_path, record):
    (tmp_path / "0_0.distcp").write_bytes(b"x" * 100)
    (tmp_path / "1_0.distcp").write_bytes(b"x" * 300)
    (tmp_path / "0.metadata").write_bytes(b"m")
    weight = paddle.arange(12, dtype="float32").reshape([3, 4])
    piece = ShardedWeight(key="w", local_tensor=weight, local_shape=(3, 4), global_shape=(6, 4), global_offset=(0, 0))
    with paddle.LazyGuard():
        lazy = paddle.nn.Linear(4, 2).weight
    assert not lazy._is_initialized()
    moment = paddle.ones([5], dtype="float32")
    load = fake_checkpoint._make_load_state_dict(dcp_load.load_state_dict, lambda: True)
    # Paddle's own parameters, bound by name as Paddle's signature takes them
    assert load({"w": piece, "lazy": lazy, "opt": {"m": moment}}, str(tmp_path), aoa_config=None) is None
    np.testing.assert_array_equal(weight.numpy(), np.arange(12, dtype="float32").reshape(3, 4))
    np.testing.assert_array_equal(moment.numpy(), np.ones(5, dtype="float32"))
    assert lazy._is_initialized() and list(lazy.shape) == [4, 2]
    (entry,) = record.loads()
    assert entry == {"path": str(tmp_path), "format": "distcp", "aoa": False, "tensors": 3,
                     "bytes": 12 * 4 + 8 * 4 + 5 * 4, "materialized": 1, "files": 2, "file_bytes": 400,
                     "largest_file_bytes": 300, "weights_read": False}


def test_paddle_itself_is_never_called_in_a_fake_world(tmp_path, record):
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"h" * 10)
    load = fake_checkpoint._make_load_state_dict(dcp_load.load_state_dict, lambda: True)
    original = dcp_load._load_state_dict
    dcp_load._load_state_dict = _refuse  # the resharder's entry: not reached
    try:
        load({"w": paddle.zeros([2])}, str(tmp_path), safetensors=True, aoa_config={"aoa_statements": []})
    finally:
        dcp_load._load_state_dict = original
    (entry,) = record.loads()
    assert entry["format"] == "safetensors" and entry["aoa"] is True and entry["files"] == 1


def test_a_missing_checkpoint_fails_as_in_the_real_run(tmp_path, record):
    load = fake_checkpoint._make_load_state_dict(dcp_load.load_state_dict, lambda: True)
    with paddle.LazyGuard():
        lazy = paddle.nn.Linear(4, 2).weight
    with pytest.raises(FileNotFoundError):
        load({"w": lazy}, str(tmp_path / "not-there"))
    assert record.loads() == [] and not lazy._is_initialized()  # nothing done before the directory was found


def test_a_mirrored_model_directory_is_named_by_the_files_it_links_to(tmp_path, record):
    """``--compose-layers`` runs a mirror of the model directory (links to its files): the note names the user's."""
    real = tmp_path / "model"
    real.mkdir()
    (real / "model.safetensors").write_bytes(b"s" * 7)
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    os.symlink(real / "model.safetensors", mirror / "model.safetensors")
    load = fake_checkpoint._make_load_state_dict(dcp_load.load_state_dict, lambda: True)
    load({}, str(mirror), safetensors=True)
    (entry,) = record.loads()
    assert entry["path"] == str(real) and entry["file_bytes"] == 7 and entry["tensors"] == 0
