"""Worker of ``test_deepep_dispatch.py`` (2 gloo ranks): DeepEP's dispatch and combine as PaddleFormers
calls them where DeepEP is absent (``paddleformers.transformers.token_dispatcher.fused_dispatch`` /
``fused_combine``, the plugin's ``deepep_gloo``), and PaddleFormers' own ``MoEFlexTokenDispatcher``
on top of them; each rank saves its inputs and what it got, and the test checks them against numpy
on every rank's data.

4 experts (2 a rank), top-2, hidden 3.  The routings (the same generator on every rank):

* ``spread``: rank 0 has 5 tokens, rank 1 has 4; experts from {0, 1, 2} (expert 3 gets no token),
  some tokens on both ranks' experts, some with both experts on one rank;
* ``masked``: the same with one top-k position -1 (DeepEP's "no expert"; the dispatch only: PaddleFormers'
  dispatcher, which takes the top-k of dense probabilities, never gives one);
* ``one_rank``: every token chooses experts 0 and 1 (rank 0's): rank 1 receives no token and its
  experts none.

Each rank's expert ``e`` is the linear map ``W[e]`` (a parameter, the same values on every rank for
the reference); the loss is ``sum(out * G)`` with ``G`` fixed per rank.
"""
import numpy as np
import paddle
import paddle.distributed as dist

import paddle_hybrid  # noqa: F401
from paddle_hybrid.testing import save_result

E, K, H = 4, 2, 3


def routing(case, rank):
    rng = np.random.default_rng(100 + rank)
    if case in ("spread", "masked"):
        n = 5 if rank == 0 else 4
        idx = np.stack([rng.choice(3, size=2, replace=False) for _ in range(n)]).astype("int64")
        idx[0] = [0, 2] if rank == 0 else [2, 1]  # one token on both ranks' experts, at least
        idx[1] = [1, 0]  # both on rank 0
        if case == "masked":
            idx[n - 1, 1] = -1
    else:
        n = 4
        idx = np.stack([rng.permutation([0, 1]) for _ in range(n)]).astype("int64")
    x = rng.normal(size=(n, H)).astype("float32")
    w = rng.uniform(0.1, 1.0, size=(n, K)).astype("float32")
    w[idx < 0] = 0.0
    grad_out = rng.normal(size=(n, H)).astype("float32")
    return x, idx, w, grad_out


def experts_weights():
    return np.random.default_rng(7).normal(size=(E, H, H)).astype("float32")


def run_fused(case, group, td):
    rank = dist.get_rank()
    x_np, idx_np, w_np, g_np = routing(case, rank)
    per_rank = E // group.nranks
    weights = experts_weights()
    mine = {e: paddle.create_parameter([H, H], "float32", default_initializer=paddle.nn.initializer.Assign(
        weights[e])) for e in range(rank * per_rank, (rank + 1) * per_rank)}
    x = paddle.to_tensor(x_np, stop_gradient=False)
    w = paddle.to_tensor(w_np, stop_gradient=False)
    recv_x, recv_w, states = td.fused_dispatch(x, paddle.to_tensor(idx_np), w, E, group)
    local = states["dispatched_indices"]
    y = paddle.zeros_like(recv_x)
    for k in range(K):
        for e, param in mine.items():
            chosen = (local[:, k] == e - rank * per_rank).astype("float32").unsqueeze(-1)
            y = y + chosen * recv_w[:, k:k + 1] * paddle.matmul(recv_x, param)
    out = td.fused_combine(y, group, states["handle"])
    (out * paddle.to_tensor(g_np)).sum().backward()
    return {"x": x_np, "idx": idx_np, "w": w_np, "grad_out": g_np, "recv_x": recv_x.numpy(),
            "recv_w": recv_w.numpy(), "recv_idx": local.numpy(), "tokens_per_expert": states["tokens_per_expert"],
            "out": out.numpy(), "grad_x": x.grad.numpy(), "grad_w": w.grad.numpy(),
            "grad_experts": {e: p.grad.numpy() if p.grad is not None else np.zeros([H, H], "float32")
                             for e, p in mine.items()},
            "handle": repr(states["handle"])}


def run_dispatcher(case, group, td):
    """PaddleFormers' MoEFlexTokenDispatcher (as DeepSeek-V3's layer drives it) on the same routing."""
    rank = dist.get_rank()
    x_np, idx_np, w_np, g_np = routing(case, rank)
    per_rank = E // group.nranks
    weights = experts_weights()
    mine = [paddle.create_parameter([H, H], "float32", default_initializer=paddle.nn.initializer.Assign(weights[e]))
            for e in range(rank * per_rank, (rank + 1) * per_rank)]
    dense = np.zeros((x_np.shape[0], E), "float32")
    for t, row in enumerate(idx_np):
        for k, e in enumerate(row):
            if e >= 0:
                dense[t, e] = w_np[t, k]
    x = paddle.to_tensor(x_np, stop_gradient=False)
    probs = paddle.to_tensor(dense, stop_gradient=False)
    dispatcher = td.MoEFlexTokenDispatcher(per_rank, K, E, group)
    tokens, per_expert = dispatcher.token_permutation(x, probs, probs > 0)
    chunks = paddle.split(tokens, per_expert, axis=0) if tokens.shape[0] else []
    outs = [paddle.matmul(chunk, mine[i]) for i, chunk in enumerate(chunks)]
    expert_out = paddle.concat(outs, axis=0) if outs else tokens * 0
    out, _ = dispatcher.token_unpermutation(expert_out, None)
    (out * paddle.to_tensor(g_np)).sum().backward()
    return {"out": out.numpy(), "grad_x": x.grad.numpy(), "grad_probs": probs.grad.numpy(),
            "tokens_per_expert": list(per_expert),
            "grad_experts": {rank * per_rank + i: p.grad.numpy() if p.grad is not None else np.zeros([H, H], "float32")
                             for i, p in enumerate(mine)}}


def main():
    paddle.set_device("cpu")
    dist.init_parallel_env()
    import paddleformers.transformers.token_dispatcher as td

    group = dist.new_group([0, 1])
    fused = td.fused_dispatch
    result = {"rank": dist.get_rank(), "fused_dispatch": None if fused is None else f"{fused.__module__}.{fused.__name__}",
              "fused": {}, "dispatcher": {}}
    for key, run, cases in (("fused", run_fused, ("spread", "masked", "one_rank")),
                            ("dispatcher", run_dispatcher, ("spread", "one_rank"))):
        for case in cases:
            try:
                result[key][case] = run(case, group, td)
            except Exception as exc:  # noqa: BLE001  (what was raised is the result)
                result[key][case] = {"error": f"{type(exc).__name__}: {exc}"}
    save_result(result)


if __name__ == "__main__":
    main()
