"""Rank classes of a fleet topology, the ranks' description and the schedule's microbatches in flight
(no process: the functions alone)."""
from paddle_hybrid.dryrun import classes, report

NAMES = ["data", "pipe", "sharding", "sep", "context", "model"]


def topology(**degrees):
    full = {n: 1 for n in NAMES}
    full.update(degrees)
    return {"names": NAMES, "degrees": full}


def test_the_thousand_rank_job_has_one_class_per_stage():
    """tp8 x pp8 x dp16 = 1024 ranks: 8 classes of 128 ranks, each run by a rank with every other coordinate 0,
    and neighbouring stages' representatives are pipeline neighbours (stride tp)."""
    got = classes.classes_of(topology(data=16, pipe=8, model=8), 1024)
    assert [c.key for c in got] == [{"pipe": s, "sharding": 0} for s in range(8)]
    assert all(len(c.ranks) == 128 for c in got)
    assert sorted(r for c in got for r in c.ranks) == list(range(1024))
    assert [c.representative for c in got] == [8 * s for s in range(8)]


def test_sharding_ranks_are_classes_of_their_own():
    got = classes.classes_of(topology(pipe=2, sharding=2, model=2), 8)
    assert [(c.key["pipe"], c.key["sharding"], c.ranks) for c in got] == [
        (0, 0, [0, 1]), (0, 1, [2, 3]), (1, 0, [4, 5]), (1, 1, [6, 7])]


def test_a_script_without_fleet_is_one_class():
    (only,) = classes.classes_of(None, 4)
    assert only.ranks == [0, 1, 2, 3] and only.representative == 0 and only.label == "every rank"


def test_ranks_are_described_as_ranges():
    assert classes.describe_ranks([5, 0, 1, 2, 8, 9]) == "0-2, 5, 8-9"
    assert classes.describe_ranks([3]) == "3"


def test_microbatches_in_flight():
    # 1F1B: stage s of p keeps p - s microbatches (at most the step's)
    assert [report.in_flight(s, 4, 1, 8) for s in range(4)] == [4, 3, 2, 1]
    assert report.in_flight(0, 4, 1, 2) == 2
    # interleaved, 2 chunks of 4 stages, 8 microbatches: stage 0 starts (4-0-1)*2 + (2-1)*4 + 1 = 11 chunk
    # forwards before its first backward, half a microbatch each
    assert report.in_flight(0, 4, 2, 8) == 5.5
    assert report.in_flight(3, 4, 2, 8) == 2.5
    assert report.in_flight(0, 1, 1, 4) == 1
