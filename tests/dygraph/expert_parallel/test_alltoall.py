"""The gloo all-to-all family (the plugin's C++ exchange, ``ph_gloo_all_to_all_v``) on 2, 3 (odd: one
rank idle a round) and 4 ranks, and on 2-rank
subgroups of 4, against the arithmetic by hand: what rank ``r`` must receive from rank ``p`` is
known from the rule the worker's values follow (``worker_alltoall.py``)."""
import os

import numpy as np
import pytest

from paddle_hybrid.testing import launch

HERE = os.path.dirname(os.path.abspath(__file__))


def code(r, p, rows, width=2):
    return np.array([[1000 * r + 10 * p + k] * width for k in range(rows)], dtype="float32").reshape(rows, width)


def unequal(r, p):
    return (r + 2 * p) % 3


def expected(me, ranks):
    n = len(ranks)
    # the worker numbers ranks by their index in the group
    return {
        "single_equal": np.concatenate([code(p, me, 3) for p in range(n)]),
        "single_unequal_async": np.concatenate([code(p, me, unequal(p, me)) for p in range(n)]),
        "stream_single_unequal": np.concatenate([code(p, me, unequal(p, me)) for p in range(n)]),
        "list": [code(p, me, unequal(p, me)) for p in range(n)],
        "list_equal": [code(p, me, 1) for p in range(n)],
        "stream_tensor": np.concatenate([code(p, me, 2) for p in range(n)]),
        "legacy_alltoall_int64": np.array([100 * p + me for p in range(n)], dtype="int64"),
    }


def check(got, want, where):
    for form, value in want.items():
        if isinstance(value, list):
            assert len(got[form]) == len(value), (where, form)
            for a, b in zip(got[form], value):
                np.testing.assert_array_equal(a.reshape(b.shape), b, err_msg=f"{where} {form}")
        else:
            np.testing.assert_array_equal(got[form], value, err_msg=f"{where} {form}")


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_every_form_moves_what_the_arithmetic_says(nprocs):
    results = launch(os.path.join(HERE, "worker_alltoall.py"), nprocs=nprocs, timeout=240)
    # a zero-size part is in every unequal exchange
    assert any(unequal(r, p) == 0 for r in range(nprocs) for p in range(nprocs))
    for rank, result in enumerate(results):
        assert result["native_calls"] >= 7, result["native_calls"]  # every form above went through C++
        check(result["global"], expected(rank, list(range(nprocs))), f"rank {rank} of {nprocs}")
        if nprocs == 4:
            ranks = [0, 2] if rank % 2 == 0 else [1, 3]
            check(result["subgroup"], expected(ranks.index(rank), ranks), f"rank {rank} in subgroup {ranks}")
