"""paddle_hybrid.fleet_fixes: global-norm clipping with a weight shared between pipeline
stages (examples/gpt_pp.py's tied embedding), PP=2 against one process."""
import os

import numpy as np
import pytest

import paddle_hybrid
from paddle_hybrid import PluginConfig, fleet_fixes
from paddle_hybrid.testing import launch

SHORT = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "32", "--micro-batch-size", "4",
         "--accumulate-steps", "2", "--lr", "1e-2", "--corpus-chars", "20000", "--steps", "4"]


def _losses(repo_root, tmp_path, nprocs, flags, env=None):
    out = launch(os.path.join(repo_root, "examples", "gpt_pp.py"), nprocs=nprocs, timeout=300, env=env,
                 args=SHORT + flags + ["--out-dir", str(tmp_path)])
    return np.array(out[0]["losses"])


def test_pp2_clipped_like_one_process_only_with_the_fix(repo_root, tmp_path):
    """With ClipGradByGlobalNorm(1.0) active: PP=2 equals one process (rtol 1e-6) with the
    fix; without it the tied weight's norm counts twice and the losses drift (seen 1.4e-3
    at step 4)."""
    one = _losses(repo_root, tmp_path, 1, ["--pp", "1"])
    np.testing.assert_allclose(_losses(repo_root, tmp_path, 2, ["--pp", "2"]), one, rtol=1e-6)
    stock = _losses(repo_root, tmp_path, 2, ["--pp", "2"], env={"PADDLE_HYBRID_FLEET_FIXES": "0"})
    assert np.abs(stock - one).max() > 1e-4, (stock, one)


@pytest.fixture
def fixes_off():
    was = fleet_fixes.is_active()
    fleet_fixes.uninstall()
    yield
    fleet_fixes.uninstall()
    if was:
        fleet_fixes.install(paddle_hybrid.current_config())


def test_install_and_uninstall_restore(fixes_off):
    from paddle.distributed.fleet.meta_parallel.parallel_layers import pp_layers

    stock = pp_layers.PipelineLayer._synchronize_shared_weights
    fleet_fixes.install(PluginConfig(fleet_fixes=False))
    assert pp_layers.PipelineLayer._synchronize_shared_weights is stock
    fleet_fixes.install(PluginConfig())
    assert pp_layers.PipelineLayer._synchronize_shared_weights is not stock
    fleet_fixes.uninstall()
    assert pp_layers.PipelineLayer._synchronize_shared_weights is stock and not fleet_fixes.is_active()
