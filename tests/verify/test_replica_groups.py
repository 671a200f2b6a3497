"""Which replicas :func:`paddle_hybrid.common.replicas.compare` holds to each other, on ranks'
descriptions made here (no processes): an expert's parameters only between the data-parallel
ranks that hold the same experts (the same place in their expert-parallel groups), a rank's own
slice (group-sharded stage 3) never.  Seen failing before the expert rule: experts were never
compared at all (a drifted expert replica went unnoticed)."""
from paddle_hybrid.common.replicas import compare


def _rank(groups, digests, **extra):
    return {"groups": groups, "digests": digests, "split": [], "own": [], "experts": [], "expert_index": None,
            "tied": {}, **extra}


def _dp4_ep2():
    """dp 4 with expert parallel 2: ranks 0 and 2 hold experts 0-1 (place 0), ranks 1 and 3 experts 2-3."""
    return {r: _rank({"dp": [0, 1, 2, 3]}, {"embed": "e", f"experts.{2 * (r % 2)}.w": f"expert{r % 2}"},
                     experts=[f"experts.{2 * (r % 2)}.w"], expert_index=r % 2) for r in range(4)}


def test_experts_of_different_places_are_not_replicas():
    assert compare(_dp4_ep2()) == []


def test_a_drifted_expert_replica_is_found_within_its_place():
    published = _dp4_ep2()
    published[3]["digests"]["experts.2.w"] = "drifted"
    found = [(kind, ranks, name) for kind, ranks, name, _ in compare(published)]
    assert found == [("dp", (1, 3), "experts.2.w")], found


def test_a_rank_s_own_slice_is_not_compared_but_whole_parameters_are():
    published = {r: _rank({"sharding": [0, 1]}, {"big": f"slice{r}", "small": "same"}, own=["big"]) for r in range(2)}
    assert compare(published) == []
    published[1]["digests"]["small"] = "drifted"
    assert [(k, n) for k, _, n, _ in compare(published)] == [("sharding", "small")]
