"""Interleaved virtual pipeline with pp_degree == 2 on CPU/gloo (paddle_hybrid.dygraph.cpu.virtual_pipeline).

Multi-rank: PP2 x VP2 and PP2 x VP3 on 2 ranks, ``use_batch_p2p_comm`` False and True,
5 SGD steps, every rank against the single-process reference of
``pipeline_models``: losses rtol = atol = 1e-5, parameters atol = 1e-5
(summation order of the microbatches may differ; here they come out equal).

In-process: what the patch changes and that ``uninstall()`` restores it; and the reason
Paddle refuses two stages, shown on its own batched p2p order.
"""
import types

import numpy as np
import pytest

import paddle
import paddle_hybrid
import pipeline_models as models
from paddle_hybrid import PluginConfig
from paddle_hybrid.dygraph import cpu
from paddle_hybrid.testing import launch

TIMEOUT = 180
RTOL = ATOL = 1e-5
STEPS = 5
STOCK_MSG = "virtual pipeline must run under pp degree > 2"


def _run(acc, variants):
    return launch(models.__file__, nprocs=2, timeout=TIMEOUT,
                  args=["--pp", "2", "--acc", str(acc), "--steps", str(STEPS), "--variants", ";".join(variants)])


def _check(res, variants, model_class):
    assert [r["stage"] for r in res] == [0, 1]
    for spec in variants:
        assert res[0]["variants"][spec]["losses"] == res[1]["variants"][spec]["losses"], spec
        for r in res:
            v = r["variants"][spec]
            where = f"rank {r['rank']} variant {spec!r}"
            assert v["model_class"] == model_class, where
            assert len(v["losses"]) == STEPS, where
            np.testing.assert_allclose(v["losses"], v["ref_losses"], rtol=RTOL, atol=ATOL, err_msg=where)
            assert len(v["params"]) == 12, where  # 6 of the 12 blocks (w, b) on each rank
            for k, got in v["params"].items():
                np.testing.assert_allclose(got, v["ref_params"][k], rtol=0, atol=ATOL, err_msg=f"{where} {k}")


VARIANTS = ["vpp=2", "vpp=2,batch_p2p=1", "vpp=3", "vpp=3,batch_p2p=1"]


def test_pp2_interleaved_vp2_vp3_match_one_process():
    # accumulate_steps >= 2 * pp: PipelineParallelWithInterleave (its four-way exchange).
    _check(_run(4, VARIANTS), VARIANTS, "PipelineParallelWithInterleave")


def test_pp2_interleaved_uneven_accumulate_steps():
    # 5 % 2 != 0: the first chunk runs 3 microbatches, the last stage buffers its sends.
    variants = ["vpp=2", "vpp=2,batch_p2p=1"]
    _check(_run(5, variants), variants, "PipelineParallelWithInterleave")


def test_pp2_interleaved_f_then_b_matches_one_process():
    # pp <= accumulate_steps < 2 * pp: PipelineParallelWithInterleaveFthenB.
    variants = ["vpp=2", "vpp=2,batch_p2p=1"]
    _check(_run(2, variants), variants, "PipelineParallelWithInterleaveFthenB")


# ---------------------------------------------------------------------------
# in-process
# ---------------------------------------------------------------------------

def _classes():
    from paddle.distributed.fleet.meta_parallel import pipeline_parallel as pp

    return pp.PipelineParallelWithInterleave, pp.PipelineParallelWithInterleaveFthenB


class ProcessGroupGloo:
    """Named like Paddle's gloo process group (the two-stage lift applies only on gloo)."""


def _fake(num_stages, acc):
    gloo_group = types.SimpleNamespace(process_group=ProcessGroupGloo())
    hcg = types.SimpleNamespace(get_pipe_parallel_group=lambda: gloo_group)
    return types.SimpleNamespace(num_stages=num_stages, accumulate_steps=acc, _hcg=hcg)


def test_check_sanity_patched_and_uninstall_restores(fresh_plugin):
    interleave, fthenb = _classes()
    stock = {c: vars(c)["_check_sanity"] for c in (interleave, fthenb)}
    for c in stock:  # stock Paddle 3.3.1 refuses two stages
        with pytest.raises(AssertionError, match=STOCK_MSG):
            c._check_sanity(_fake(2, 8))

    paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    assert (interleave, "_check_sanity") in cpu.patched() and (fthenb, "_check_sanity") in cpu.patched()
    for c in stock:
        assert vars(c)["_check_sanity"] is not stock[c]
        c._check_sanity(_fake(2, 4))
        with pytest.raises(AssertionError, match=STOCK_MSG):  # pp == 1: Paddle's own check
            c._check_sanity(_fake(1, 4))
    with pytest.raises(AssertionError, match=r"accumulate_steps \(3\) must be >= 2 \* pp degree \(2\)"):
        interleave._check_sanity(_fake(2, 3))
    with pytest.raises(AssertionError, match=r"accumulate_steps\(5\) should be greater"):
        interleave._check_sanity(_fake(3, 5))  # pp > 2: Paddle's own checks and messages
    interleave._check_sanity(_fake(3, 6))

    paddle_hybrid.uninstall_component("cpu")
    assert {c: vars(c)["_check_sanity"] for c in stock} == stock


class _Msg:
    shape = (4,)

    def __init__(self, kind, owner):
        self.kind, self.owner = kind, owner  # kind: "act" / "grad"; owner: sender, or receiver's buffer


class _Hcg:
    def __init__(self, rank, pp):
        self.rank, self.pp = rank, pp

    def get_stage_id(self):
        return self.rank

    def _get_p2p_prev_rank(self):
        return (self.rank - 1) % self.pp

    def _get_p2p_next_rank(self):
        return (self.rank + 1) % self.pp

    def get_pipe_parallel_group(self):
        return None

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_group(self):
        return None


def _posted(fn, p2p, monkeypatch, rank, pp):
    """The (op, message, peer) sequence ``fn`` posts for a four-way exchange on ``rank``."""
    posted = []
    send = p2p._send_on_calc_stream
    monkeypatch.setattr(p2p, "batch_send_recv_on_calc_stream",
                        lambda ops: posted.extend(("send" if o.op is send else "recv", o.tensor, o.peer)
                                                  for o in ops))
    monkeypatch.setattr(paddle.distributed, "isend", lambda t, peer, group: posted.append(("send", t, peer)))
    monkeypatch.setattr(paddle.distributed, "irecv", lambda t, peer, group: posted.append(("recv", t, peer)))
    hcg = _Hcg(rank, pp)
    monkeypatch.setattr(p2p, "_hcg", hcg)
    fn(_Msg("grad", rank), _Msg("act", rank), _Msg("act", rank), _Msg("grad", rank), hcg)
    return posted


def _pairings(fn, p2p, monkeypatch, pp):
    """Messages matched as NCCL matches p2p between two ranks: in posting order, per
    (sender, receiver).  Returns [(sent kind, receiving buffer kind)]."""
    posted = {r: _posted(fn, p2p, monkeypatch, r, pp) for r in range(pp)}
    out = []
    for a in range(pp):
        for b in range(pp):
            sends = [m for op, m, peer in posted[a] if op == "send" and peer == b]
            recvs = [m for op, m, peer in posted[b] if op == "recv" and peer == a]
            assert len(sends) == len(recvs)
            out.extend((s.kind, r.kind) for s, r in zip(sends, recvs))
    return posted, out


def test_why_paddle_refuses_two_stages(fresh_plugin, monkeypatch):
    """Paddle's batched order (send_prev, recv_prev, send_next, recv_next on every rank)
    crosses activation and gradient when prev == next; its stage-parity order, which
    .p2p posts on gloo for both paths, does not, and on one pair group each rank's k-th
    operation is the complement of the peer's k-th."""
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    assert not cpu.is_active()  # Paddle's own functions
    _, pairs = _pairings(p2p._batched_p2p_ops, p2p, monkeypatch, pp=2)
    assert ("grad", "act") in pairs and ("act", "grad") in pairs  # swapped
    _, pairs = _pairings(p2p._batched_p2p_ops, p2p, monkeypatch, pp=3)
    assert all(s == r for s, r in pairs) and len(pairs) == 6  # distinct peers: nothing to confuse

    posted, pairs = _pairings(p2p._p2p_ops, p2p, monkeypatch, pp=2)
    assert all(s == r for s, r in pairs) and len(pairs) == 4
    flip = {"send": "recv", "recv": "send"}
    assert [flip[op] for op, _, _ in posted[0]] == [op for op, _, _ in posted[1]]
    assert [m.kind for _, m, _ in posted[0]] == [m.kind for _, m, _ in posted[1]]
