"""The CPU routing kernels against plain-loop NumPy references that follow the GPU kernels'
arithmetic one token (or one worker) at a time, in the order the CPU versions fix (ascending
token index, ascending worker).  Edge cases: an expert with no token, every token to one
expert, capacity exceeded, ``-1`` entries, an empty batch."""
import numpy as np
import paddle
import pytest

from paddle.distributed.models.moe import utils as moe_utils
from paddle_hybrid.dygraph.expert_parallel import routing_kernels as k


def t(a):
    return paddle.to_tensor(np.asarray(a, dtype="int64"))


# ---- references: sequential loops ------------------------------------------------------

def ref_number_count(idx, upper):
    out = np.zeros(upper, np.int64)
    for v in np.asarray(idx).reshape(-1):
        if 0 <= v < upper:
            out[v] += 1
    return out


def ref_assign_pos(idx, cum):
    cum = np.array(cum).copy()
    flat = np.asarray(idx).reshape(-1)
    out = np.zeros(cum[-1] if cum.size else 0, np.int64)
    # the GPU kernel fills each expert's segment from its end; the CPU order is ascending index,
    # i.e. this loop run backwards over the tokens
    for i in reversed(range(flat.size)):
        e = flat[i]
        if e > -1:
            cum[e] -= 1
            out[cum[e]] = i
    return out


def ref_limit_by_capacity(counts, cap, n_worker):
    counts = np.asarray(counts).reshape(n_worker, -1)
    left = np.array(cap).copy()
    out = np.zeros_like(counts)
    for w in range(n_worker):
        for e in range(counts.shape[1]):
            proposal = counts[w, e]
            old = left[e]
            left[e] -= proposal
            out[w, e] = proposal if old >= proposal else (old if old >= 0 else 0)
    return out.reshape(-1)


def ref_prune(idx, count):
    count = np.array(count).copy()
    flat = np.asarray(idx).reshape(-1).copy()
    for i in range(flat.size):
        e = flat[i]
        if e == -1:
            continue
        old = count[e]
        count[e] -= 1
        if old <= 0:
            flat[i] = -1
    return flat.reshape(np.asarray(idx).shape)


def ref_random_routing(prob, value, idx):
    out = np.array(idx).copy()
    for r in range(out.shape[0]):
        if 2 * value[r, 1] < prob[r]:
            out[r, 1] = -1
    return out


ROUTINGS = {
    "mixed": [[0, 3], [2, 0], [3, 3], [1, 0], [0, 2], [-1, 1]],
    "expert 1 gets nothing": [[0, 2], [2, 0], [3, 0], [0, 3]],
    "every token to one expert": [[2, 2], [2, 2], [2, 2]],
    "empty batch": np.zeros([0, 2], np.int64),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_number_count_and_assign_pos(name):
    idx = np.asarray(ROUTINGS[name], np.int64)
    counts = k.number_count(t(idx), 4).numpy()
    np.testing.assert_array_equal(counts, ref_number_count(idx, 4))
    cum = np.cumsum(counts)
    np.testing.assert_array_equal(k.assign_pos(t(idx), t(cum)).numpy(), ref_assign_pos(idx, cum))


def test_number_count_ignores_out_of_range_like_the_gpu_kernel():
    np.testing.assert_array_equal(k.number_count(t([0, 5, -1, 1, 1]), 3).numpy(), [1, 2, 0])


def test_assign_pos_refuses_a_cum_count_that_does_not_match():
    with pytest.raises(ValueError, match="cum_count"):
        k.assign_pos(t([0, 1, 1]), t([1, 2]))


@pytest.mark.parametrize("counts,cap,n_worker", [
    ([3, 1, 2, 4, 0, 5], [4, 6, 2], 2),        # capacity exceeded on experts 0 and 2
    ([1, 1, 1, 1], [10, 10], 2),                # never exceeded
    ([0, 0, 5, 0, 5, 0], [3, 0], 3),            # zero capacity, a worker offering nothing
    ([7, 2, 9, 1], [0, 4], 2),
])
def test_limit_by_capacity(counts, cap, n_worker):
    np.testing.assert_array_equal(k.limit_by_capacity(t(counts), t(cap), n_worker).numpy(),
                                  ref_limit_by_capacity(counts, cap, n_worker))


@pytest.mark.parametrize("idx,count", [
    ([[1, 3], [3, 3], [0, 2], [1, 1]], [1, 2, 0, 2]),   # capacity exceeded, expert 2 gets none
    ([2, 2, 2, 2, 2], [0, 0, 3, 0]),                     # every token to one expert
    ([[0, -1], [1, 0]], [1, 1]),                          # -1 stays -1
    (np.zeros([0, 2], np.int64), [1, 1]),
])
def test_prune_gate_by_capacity(idx, count):
    idx = np.asarray(idx, np.int64)
    got = k.prune_gate_by_capacity(t(idx), t(count), len(count), 1).numpy()
    np.testing.assert_array_equal(got, ref_prune(idx, count))
    assert got.shape == idx.shape


def test_prune_refuses_an_index_beyond_the_experts():
    with pytest.raises(ValueError, match="out of range"):
        k.prune_gate_by_capacity(t([0, 4]), t([1, 1, 1, 1]), 2, 2)


@pytest.mark.parametrize("counts, capacity, n_worker, match", [
    ([1, 2, 3], [4, 4], 2, "not a multiple of n_worker=2"),   # Paddle's kernel: tail of Out uninitialised
    ([1, 2, 3, 4], [4], 2, "capacity has 1 entries for 2 experts"),  # Paddle's: writes past capacity's end
    ([1, 2], [4, 4], 0, "n_worker=0"),                        # Paddle's: a division by zero on the host
])
def test_limit_by_capacity_refuses_what_paddles_kernel_does_not_check(counts, capacity, n_worker, match):
    with pytest.raises(ValueError, match=match):
        k.limit_by_capacity(t(counts), t(capacity), n_worker)


def test_random_routing_refuses_a_topk_idx_that_is_not_2d():
    """Paddle's kernel reads dims[0] and dims[1] of topk_idx unchecked."""
    with pytest.raises(ValueError, match=r"shape \[N, 2\]"):
        k.random_routing(paddle.to_tensor(np.ones(3, "float32")), paddle.to_tensor(np.ones((3, 2), "float32")),
                         t(np.zeros(3)))


def test_random_routing():
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 8, size=(50, 2))
    value = rng.random((50, 2)).astype("float32")
    prob = rng.random(50).astype("float32")
    got = k.random_routing(paddle.to_tensor(prob), paddle.to_tensor(value), t(idx)).numpy()
    want = ref_random_routing(prob, value, idx)
    np.testing.assert_array_equal(got, want)
    assert (want[:, 1] == -1).any() and (want[:, 1] != -1).any()


def test_int32_is_refused_as_by_paddle():
    with pytest.raises(TypeError, match="int64"):
        k.number_count(paddle.to_tensor([0, 1], dtype="int32"), 2)


def test_paddle_wrappers_reach_the_cpu_kernels():
    """Through Paddle's own wrappers (what the gates call), with the plugin installed."""
    idx = t([[0, 3], [2, 0], [3, 3]])
    np.testing.assert_array_equal(moe_utils._number_count(idx, 4).numpy(), [2, 0, 1, 3])
    np.testing.assert_array_equal(moe_utils._assign_pos(idx, t([2, 2, 3, 6])).numpy(), [0, 3, 2, 1, 4, 5])
    np.testing.assert_array_equal(moe_utils._limit_by_capacity(t([3, 1, 2, 4]), t([4, 3]), 2).numpy(),
                                  [3, 1, 1, 2])
    np.testing.assert_array_equal(moe_utils._prune_gate_by_capacity(t([1, 1, 0]), t([1, 1]), 2, 1).numpy(),
                                  [1, -1, 0])
    out = moe_utils._random_routing(t([[0, 1]]), paddle.to_tensor([[0.9, 0.1]]), paddle.to_tensor([0.5]))
    np.testing.assert_array_equal(out.numpy(), [[0, -1]])
