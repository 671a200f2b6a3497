"""examples/static_pipeline.py: the user-facing static pipeline trains on CPU to the numbers of the
same model run by one process without a pipeline, on every rank, with send-wait on and off.

Tolerances: one process computes each step's gradient on the stacked micro-batches, the pipeline
sums per micro-batch gradients scaled by 1/accumulate_steps, so float32 summation order differs:
losses rtol 1e-5 (seen 2e-7), parameters after Adam atol 2e-5 (seen 6e-6).  Send-wait on and off
run the same arithmetic (it removes waits and adds a keep-alive): compared exactly.
"""
import os

import numpy as np
import pytest

from paddle_hybrid.testing import launch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FLAGS = ["--steps", "12", "--log-every", "100", "--corpus-chars", "20000"]


def _run(repo_root, stages, *flags, send_wait=None):
    env = {} if send_wait is None else {"PADDLE_HYBRID_SEND_WAIT": "1" if send_wait else "0"}
    return launch(os.path.join(repo_root, "examples", "static_pipeline.py"), nprocs=stages,
                  args=FLAGS + ["--stages", str(stages), *flags], timeout=240, env=env)


@pytest.fixture(scope="module")
def one_process():
    (result,) = _run(REPO_ROOT, 1)
    return result


def _check_against(results, reference):
    for r in results:
        np.testing.assert_array_equal(r["losses"], results[-1]["losses"])  # every rank, the same losses
        np.testing.assert_allclose(r["losses"], reference["losses"], rtol=1e-5, err_msg=f"rank {r['rank']}")
        for name, value in r["params"].items():
            np.testing.assert_allclose(value, reference["params"][name], rtol=1e-4, atol=2e-5,
                                       err_msg=f"rank {r['rank']} {name}")
    # the stages together hold every parameter of the model, each exactly once
    names = [name for r in results for name in r["params"]]
    assert sorted(names) == sorted(reference["params"])


def test_the_loss_falls(one_process):
    losses = one_process["losses"]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.2, losses


@pytest.mark.parametrize("stages,schedule", [(2, "1F1B"), (3, "F-then-B")])
def test_pipeline_trains_like_one_process_with_send_wait_on_and_off(repo_root, one_process, stages, schedule):
    with_wait = _run(repo_root, stages, "--schedule", schedule, send_wait=True)
    without = _run(repo_root, stages, "--schedule", schedule, send_wait=False)
    _check_against(with_wait, one_process)
    for a, b in zip(with_wait, without):
        np.testing.assert_array_equal(a["losses"], b["losses"])
        for name in a["params"]:
            np.testing.assert_array_equal(a["params"][name], b["params"][name], err_msg=name)
    # the program that trained passed the send-lifetime checker: one kept-alive forward send per
    # stage but the last (send-wait off: the stream syncs hold them, the checker still passes)
    assert [r["send_lifetimes_checked"] for r in with_wait] == [1] * (stages - 1) + [0]
    assert [r["send_lifetimes_checked"] for r in without] == [1] * (stages - 1) + [0]


def test_wrong_process_count_is_refused(repo_root):
    from paddle_hybrid.testing import LaunchError

    with pytest.raises(LaunchError) as caught:
        launch(os.path.join(repo_root, "examples", "static_pipeline.py"), nprocs=1, args=FLAGS + ["--stages", "2"],
               timeout=120)
    assert "--stages 2 needs 2 processes" in str(caught.value)
