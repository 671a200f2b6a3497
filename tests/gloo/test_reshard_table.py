"""Every dygraph ``dist.reshard`` between Replicate, Shard(0), Shard(1) and Partial, against what one
process holds (NumPy's part of the global tensor), with the plugin's gloo kernels:

* 4 ranks: the 12 pairs on a 1-D mesh, every pair of 2-D placements on a 2 x 2 mesh (no tensor
  dimension sharded twice: 14 placements, 182 pairs) and each placement on mesh [0, 1] to
  Replicate / Shard(0) / Shard(1) on mesh [2, 3];
* 3 ranks, 5 rows (parts 2, 2, 1): the 12 pairs with an uneven dimension;
* 3 ranks, 4 rows (parts 2, 2, 0): what Paddle cannot do on any device stops on every rank with
  the plugin's message, the rest is right.

Exact: small integers.  A Partial result is right when its shares add up to the value over the
partial mesh dimensions.  Stock Paddle on CPU stops at 4 of the 12 1-D pairs (P -> S, S -> S:
``test_semi_auto_parallelize.py`` shows it); without ``fleet_fixes.uneven_reshard`` an uneven
Shard -> Shard stops on some ranks and hangs the others (``test_uneven_shard_to_shard_plan``)."""
import os
from collections import defaultdict

import numpy as np
import pytest

from paddle_hybrid.testing import launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker_reshard_table.py")


def _wrong_cases(results) -> dict:
    """``{case: why}`` for every case some rank got wrong."""
    wrong = {}
    partial_sums = defaultdict(dict)  # case -> coordinate outside the partial dims -> [sum, expected]
    for result in results:
        for case, value in result["cases"].items():
            if "error" in value:
                wrong[case] = f"rank {result['rank']}: {value['error']}"
            elif value.get("partial"):
                names = case.split(" -> ")[1]
                key = tuple(c for c, n in zip(value["coord"], _names(names)) if n != "P")
                got = np.asarray(value["got"])
                total, expected = partial_sums[case].get(key, (0, np.asarray(value["expected"])))
                partial_sums[case][key] = (total + got, expected)
            elif "got" in value:
                got = np.asarray(value["got"]).reshape(value["shape"])
                expected = np.asarray(value["expected"]).reshape(value["expected_shape"])
                if got.shape != expected.shape or not np.array_equal(got, expected):
                    wrong[case] = f"rank {result['rank']}: {got.shape} {got.ravel()[:6]} != {expected.shape} {expected.ravel()[:6]}"
    for case, groups in partial_sums.items():
        for key, (total, expected) in groups.items():
            if not np.array_equal(total, expected):
                wrong[case] = f"shares at {key} add up to {np.ravel(total)[:6]}, not {np.ravel(expected)[:6]}"
    return wrong


def _names(text: str) -> list:
    """``"S0P"`` -> ``["S0", "P"]``; ``"S1"`` -> ``["S1"]``."""
    names, i = [], 0
    while i < len(text):
        step = 2 if text[i] == "S" else 1
        names.append(text[i:i + step])
        i += step
    return names


def test_every_reshard_pair_on_1d_2d_and_across_meshes():
    results = launch(WORKER, nprocs=4, timeout=300)
    cases = results[0]["cases"]
    assert len([c for c in cases if c.startswith("1-D")]) == 12
    assert len([c for c in cases if c.startswith("2-D")]) == 14 * 13
    assert len([c for c in cases if c.startswith("mesh")]) == 12
    assert _wrong_cases(results) == {}


def test_uneven_parts_reshard_like_one_process():
    results = launch(WORKER, nprocs=3, timeout=300, env={"W_ROWS": 5})
    assert results[0]["cases"]["1-D S0 -> S1"]["shape"] == [5, 2]
    assert results[2]["cases"]["1-D R -> S0"]["shape"] == [1, 6]
    assert _wrong_cases(results) == {}


def test_an_empty_part_stops_every_rank_with_the_reason():
    results = launch(WORKER, nprocs=3, timeout=300, env={"W_ROWS": 4})
    wrong = _wrong_cases(results)
    assert sorted(wrong) == ["1-D S0 -> P", "1-D S0 -> R", "1-D S0 -> S1"], wrong
    for result in results:
        for case in wrong:
            error = result["cases"][case]["error"]
            assert error.startswith("UnevenReshardError") and "[2, 2, 0]" in error, (result["rank"], error)


@pytest.mark.parametrize("shape,mesh,src,dst,middle", [
    ([5, 6], [2], ["S0"], ["S1"], ["R"]),        # uneven source: through Replicate
    ([6, 5], [2], ["S0"], ["S1"], ["R"]),        # uneven destination
    ([6, 6], [2], ["S0"], ["S1"], None),         # even: Paddle's all-to-all
    ([5, 6], [2], ["S0"], ["R"], None),          # Shard -> Replicate pads the last part itself
    ([5, 6], [2], ["P"], ["S0"], None),
    ([4, 5], [2, 2], ["S0", "S1"], ["S1", "S0"], ["R", "R"]),  # 2 x 2 mesh: 5 columns either way
    ([4, 6], [2, 2], ["S0", "S1"], ["S1", "S0"], None),
])
def test_uneven_shard_to_shard_plan(shape, mesh, src, dst, middle):
    import paddle.distributed as dist

    from paddle_hybrid.dygraph.fleet_fixes import uneven_reshard

    make = {"R": dist.Replicate, "P": dist.Partial, "S0": lambda: dist.Shard(0), "S1": lambda: dist.Shard(1)}
    got = uneven_reshard.plan(shape, mesh, [make[n]() for n in src], [make[n]() for n in dst])
    assert (None if got is None else [uneven_reshard._describe(p) for p in got]) == \
        (None if middle is None else [{"R": "Replicate"}.get(n, n) for n in middle])


def test_an_empty_part_is_refused_before_any_communication():
    import paddle.distributed as dist

    from paddle_hybrid.dygraph.fleet_fixes import uneven_reshard

    with pytest.raises(uneven_reshard.UnevenReshardError, match=r"\[2, 2, 0\]"):
        uneven_reshard.plan([4, 6], [3], [dist.Shard(0)], [dist.Replicate()])
    assert uneven_reshard.plan([4, 6], [3], [dist.Replicate()], [dist.Shard(0)]) is None
