"""Fleet's legacy static pipeline trains on CPU over gloo (2 and 3 stages, 1F1B and F-then-B,
4 micro-batches), with the send-wait rewrite on and off, on every rank.

Each configuration is one launch of ``worker_pipeline.py`` (one process per stage), compared
with the one-process NumPy reference of ``reference.py`` (float64).  Tolerances: the pipeline
computes in float32 and sums micro-batch gradients where the reference sums in float64, so
losses and parameters are compared with rtol 1e-5 / atol 1e-6 (the largest difference seen is
5e-8); every rank returns the same losses (the last stage broadcasts them), compared exactly.
"""
import functools
import os

import numpy as np
import pytest

import reference
from paddle_hybrid.testing import launch

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = {2: 3, 3: 2}


@functools.lru_cache(maxsize=None)
def run(stages, schedule, send_wait, drop_nop=False, feed=False):
    args = (["--stages", stages, "--schedule", schedule, "--steps", STEPS[stages]] + (["--drop-nop"] if drop_nop else [])
            + (["--feed"] if feed else []))
    return launch(os.path.join(HERE, "worker_pipeline.py"), nprocs=stages, args=args, timeout=240,
                  env={"PADDLE_HYBRID_SEND_WAIT": "1" if send_wait else "0",
                       "PADDLE_HYBRID_STATIC_PIPELINE_TIMEOUT": "60"})


def _check_numbers(results, stages):
    ref_losses, ref_params = reference.train(stages, STEPS[stages])
    for r in results:
        np.testing.assert_array_equal(np.array(r["losses"]), np.array(results[-1]["losses"]))
        assert np.array(r["losses"]).shape == (STEPS[stages], 4)  # one loss per micro-batch and step
        np.testing.assert_allclose(np.array(r["losses"]), np.array(ref_losses), rtol=1e-5, atol=1e-6)
        assert sorted(r["params"]) == sorted([f"w{r['stage']}", f"b{r['stage']}"])
        for name, value in r["params"].items():
            np.testing.assert_allclose(value, ref_params[name], rtol=1e-5, atol=1e-6, err_msg=name)


CONFIGS = [(stages, schedule, send_wait) for stages in (2, 3) for schedule in ("1F1B", "F-then-B")
           for send_wait in (True, False)]


@pytest.mark.parametrize("stages,schedule,send_wait", CONFIGS)
def test_trains_like_one_process(stages, schedule, send_wait):
    results = run(stages, schedule, send_wait)
    assert [r["stage"] for r in results] == list(range(stages))
    _check_numbers(results, stages)


@pytest.mark.parametrize("stages,schedule,send_wait", CONFIGS)
def test_send_wait_switch_and_checker(stages, schedule, send_wait):
    """The program that trained is the one the rewrite produced (or not), and it passes the
    lifetime checker: every stage but the last sends one activation forward."""
    for r in run(stages, schedule, send_wait):
        forward_sends = 0 if r["stage"] == stages - 1 else 1
        assert r["ph_nops"] == (forward_sends if send_wait else 0), r
        assert r["checker"] == forward_sends, r["checker"]


@pytest.mark.parametrize("schedule", ["1F1B", "F-then-B"])
def test_negative_control_without_keepalive(schedule):
    """Send-wait with its keep-alive dropped: the checker rejects every stage that sends forward;
    the numbers stay right, because on gloo each send takes a copy of its data when queued (and a
    recv returns only with the data), so freeing the variable early changes nothing sent."""
    results = run(2, schedule, True, drop_nop=True)
    assert results[0]["ph_nops"] == 0
    assert results[0]["checker"].startswith("SendLifetimeError"), results[0]["checker"]
    assert "no op reads it after" in results[0]["checker"]
    assert results[1]["checker"] == 0  # the last stage sends nothing forward
    _check_numbers(results, 2)


def test_feed_dicts():
    """The same training fed by dicts (each a step's 4 micro-batches) instead of a DataLoader."""
    results = run(2, "1F1B", True, feed=True)
    _check_numbers(results, 2)
    assert results[0]["checker"] == 1


def test_a_missing_peer_fails_naming_the_ring():
    """The last stage stops after one step: stage 0 waits for gradients that never come and must
    fail within the timeout, naming the ring, instead of hanging."""
    from paddle_hybrid.testing import LaunchError

    args = ["--stages", 2, "--schedule", "1F1B", "--steps", 3, "--last-stage-steps", 1]
    with pytest.raises(LaunchError) as caught:
        launch(os.path.join(HERE, "worker_pipeline.py"), nprocs=2, args=args, timeout=200,
               env={"PADDLE_HYBRID_STATIC_PIPELINE_TIMEOUT": "15"})
    message = str(caught.value)
    assert "did not finish" not in message  # failed by itself, not killed by the launcher
    assert "paddle_hybrid.static.static_pipeline: ring 21" in message, message[-3000:]


def test_uninstall_stops_the_sender_threads_and_forgets_the_rings():
    """After a static pipeline trained, ``paddle_hybrid.uninstall()`` leaves no thread of the plugin
    and the plugin holds no ring; no rank listens on any port but the job's store (rank 0 hosts
    it), before the uninstall or after: the rings rendezvous on the job's store.  Seen failing
    first: the senders ("ph-pipeline-send-ring*") kept running; and with a store per ring (the
    code the prefix view replaced) the rank hosting a ring's store listened on its port, also
    after the uninstall (Paddle's comm-context manager keeps every gloo context and its store)."""
    results = launch(os.path.join(HERE, "worker_pipeline.py"), nprocs=2, args=["--steps", "1", "--uninstall-after"],
                     timeout=240)
    for rank, out in enumerate(results):
        seen = out["leftovers"]
        assert seen["before"]["threads"] and seen["before"]["rings"], (rank, seen)  # the senders ran, on rings
        assert seen["after"]["threads"] == [] and seen["after"]["rings"] == [], (rank, seen)
        job_store = [("0.0.0.0", seen["job_store_port"])] if rank == 0 else []
        assert seen["before"]["listening"] == seen["after"]["listening"] == job_store, (rank, seen)


def test_stages_with_different_accumulate_steps_stop_at_once_naming_the_field():
    """Rank 1 builds its program with accumulate_steps 2, rank 0 with 4: before the first step
    both stop, naming the field and each rank's value, within seconds under a 60 s deadline.
    Seen failing first: rank 0 waited in its send until the deadline and ended in a timeout that
    named no field."""
    results = launch(os.path.join(HERE, "worker_pipeline.py"), nprocs=2, args=["--accumulate-on", "1:2"],
                     timeout=240, env={"PADDLE_HYBRID_STATIC_PIPELINE_TIMEOUT": "60"})
    for r in results:
        error = r["agreement_error"]
        assert error is not None and "the stages of the static pipeline disagree" in error, r
        assert "pipeline_configs.accumulate_steps: rank 0: 4, rank 1: 2" in error, error
        assert r["seconds"] < 10, r
