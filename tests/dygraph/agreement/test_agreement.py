"""The start-up agreement on 2 gloo ranks: ranks that disagree stop at ``fleet.distributed_model``
within seconds, every rank naming the field and each rank's value; a rank that never arrives is
named when ``PADDLE_HYBRID_TIMEOUT`` runs out; ranks that agree go on.

Seen failing first (the code before the component): ``accumulate_steps`` and
``buckets_one_rank`` passed ``distributed_model`` without an error on both ranks (the job then
hangs in its first pipeline step until gloo's 30 s TIMEOUT)."""
import os

import pytest

from paddle_hybrid.dygraph.agreement import differences
from paddle_hybrid.testing import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_agreement.py")


def test_differences_name_each_field_and_rank():
    found = differences({0: {"a": 4, "b": 1, "c": "x"}, 1: {"a": 2, "b": 1}, 2: {"a": 4, "b": 1, "c": "x"}})
    assert found == ["a: ranks [0, 2]: 4, rank 1: 2", "c: ranks [0, 2]: 'x', rank 1: '(missing)'"]
    assert differences({0: {"a": 1}, 1: {"a": 1}}) == []


@pytest.mark.parametrize("case,field,values", [
    ("accumulate_steps", "pipeline_configs.accumulate_steps", "rank 0: 4, rank 1: 2"),
    ("buckets_one_rank", "PluginConfig.grad_buckets", "rank 0: None, rank 1: False"),
])
def test_a_mismatch_stops_every_rank_naming_it(case, field, values):
    results = launch(WORKER, 2, args=["--case", case], timeout=180)
    for rank, out in enumerate(results):
        assert out["error"] is not None and out["error"].startswith("AgreementError"), (rank, out)
        assert f"{field}: {values}" in out["error"], (rank, out["error"])
        assert out["seconds"] < 10, (rank, out["seconds"])


def test_ranks_that_agree_go_on():
    results = launch(WORKER, 2, args=["--case", "same"], timeout=180)
    for rank, out in enumerate(results):
        assert out["error"] is None, (rank, out)
        assert out["check"] is not None and out["check"] < 5, (rank, out)


def test_a_rank_that_does_not_arrive_is_named_at_the_deadline():
    results = launch(WORKER, 2, args=["--case", "absent"], timeout=180, env={"PADDLE_HYBRID_TIMEOUT": "3"})
    out = results[0]
    assert out["error"] is not None and out["error"].startswith("ExchangeTimeout"), out
    assert "waited 3 s for rank 1" in out["error"] and "PADDLE_HYBRID_TIMEOUT" in out["error"], out["error"]
    assert 3 <= out["seconds"] < 8, out["seconds"]
