"""Each pricing rule of the step-time estimate against a hand computation: a GEMM (on the grid, between grid
points, scaled to another GPU), flash attention, a memory-bound op, an all-reduce inside a node and across
nodes, a p2p message, the step of a one-stage layout; and the records against Korthikanti et al.'s counts."""
import dataclasses
import json
import math

import pytest

from fake_tables import ADAMW_RATE, ATTENTION_RATE, GEMM_RATE, MEMORY_RATE, fake_table
from paddle_hybrid.plan import comm, hardware, memory, records, tables
from paddle_hybrid.plan.estimate import FRAMEWORKS, estimate
from paddle_hybrid.plan.layout import parse
from paddle_hybrid.plan.model import PRESETS, Transformer

# Version-independent arithmetic (pricing, layouts, composition): run in one of CI's lanes (tests/conftest.py).
pytestmark = pytest.mark.one_lane


@pytest.fixture
def table_path(tmp_path):
    path = tmp_path / "fake.json"
    path.write_text(json.dumps(fake_table()))
    return str(path)


def h200_tables(path):
    return tables.load(hardware.gpu_named("h200"), path)


def test_gemm_on_and_between_grid_points(table_path):
    t = h200_tables(table_path)
    assert t.gemm(1024, 8192, 1024) == pytest.approx(2 * 1024 * 8192 * 1024 / GEMM_RATE, rel=1e-12)
    # off the grid, the flat rate interpolates to itself: time follows the FLOPs
    assert t.gemm(3000, 5000, 700, "nt") == pytest.approx(2 * 3000 * 5000 * 700 / GEMM_RATE, rel=1e-9)
    # beyond the grid, the rate of its edge
    assert t.gemm(131072, 1024, 1024) == pytest.approx(2 * 131072 * 1024 * 1024 / GEMM_RATE, rel=1e-9)


def test_gemm_rate_interpolates_in_log_shape(tmp_path):
    data = fake_table()
    for row in data["gemm"]:  # rate 100 TFLOP/s at m=1024, 400 at m=8192
        if row["m"] == 8192:
            row["time_s"] /= 4
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    t = h200_tables(str(path))
    m = int(1024 * math.sqrt(8))  # halfway in log m: the log-rate halfway, 200 TFLOP/s
    assert t.gemm(m, 1024, 1024) == pytest.approx(2 * m * 1024 * 1024 / 200e12, rel=1e-3)


def test_a_table_scaled_to_another_gpu_keeps_its_floor(table_path):
    t = tables.load(hardware.gpu_named("a100-80g"), table_path)
    floor = 2 * 128 ** 3 / GEMM_RATE
    ratio = 989e12 / 312e12
    seconds = 2 * 8192 ** 3 / GEMM_RATE
    assert t.scaled_from == "NVIDIA H200"
    assert t.gemm(8192, 8192, 8192) == pytest.approx(floor + (seconds - floor) * ratio, rel=1e-9)
    assert t.memory_bound(2 ** 30) == pytest.approx(2 ** 10 / MEMORY_RATE + (2 ** 30 - 2 ** 10) / MEMORY_RATE
                                                    * 4.8 / 2.039, rel=1e-9)


def test_attention_memory_and_adamw(table_path):
    t = h200_tables(table_path)
    flops = 4 * 64 * 4096 ** 2 * 128 * 0.5
    fwd, bwd = t.attention(64, 4096, 128)
    assert fwd == pytest.approx(flops / ATTENTION_RATE, rel=1e-9)
    assert bwd == pytest.approx(2.5 * flops / ATTENTION_RATE, rel=1e-9)
    assert t.memory_bound(3e9) == pytest.approx(3e9 / MEMORY_RATE, rel=1e-9)
    assert t.adamw(10 ** 8) == pytest.approx(10 ** 8 / ADAMW_RATE, rel=1e-9)


def test_all_reduce_inside_and_across_nodes():
    gpu = hardware.gpu_named("a100-80g")
    model = comm.CommModel(hardware.cluster(gpu, 16))
    size = 64 * 2 ** 20                      # the curve's row: 202.52 GB/s bus bandwidth on 8 A100s
    inside = comm.Placement(8, 1, 8)
    assert model.all_reduce(size, inside) == pytest.approx(2 * 7 / 8 * size / 202.52e9, rel=1e-9)
    across = comm.Placement(16, 2, 8)        # 8 NICs of 25 GB/s at 92 %: 184 GB/s < 202.52
    assert model.all_reduce(size, across) == pytest.approx(2 * 15 / 16 * size / (8 * 25e9 * 0.92), rel=1e-9)
    one_per_node = comm.Placement(4, 4, 1)
    assert model.all_gather(size, one_per_node) == pytest.approx(3 / 4 * size / (25e9 * 0.92), rel=1e-9)
    assert model.p2p(size, same_node=True) == pytest.approx(10e-6 + size / (0.8 * 300e9), rel=1e-9)
    assert model.p2p(size, same_node=False) == pytest.approx(10e-6 + size / (0.92 * 25e9), rel=1e-9)
    h100 = comm.CommModel(hardware.cluster(hardware.gpu_named("h100"), 8))
    assert h100.scaled and h100.all_reduce(size, inside) == pytest.approx(2 * 7 / 8 * size / (202.52e9 * 1.5))


def test_placement_follows_the_rank_order():
    order = ("dp", "pp", "tp")               # tp fastest
    degrees = {"tp": 8, "pp": 4, "dp": 4}
    assert comm.place(order, degrees, "tp", 8) == comm.Placement(8, 1, 8)
    assert comm.place(order, degrees, "pp", 8) == comm.Placement(4, 4, 1)
    assert comm.place(order, {"tp": 2, "pp": 2, "dp": 4}, "pp", 8) == comm.Placement(2, 1, 2)
    assert comm.place(order, {"tp": 2, "pp": 2, "dp": 4}, "dp", 8) == comm.Placement(4, 2, 2)


def _flops(ops, phase):
    return sum(2 * op.shape[0] * op.shape[1] * op.shape[2] for op in ops if op.kind == "gemm" and op.phase == phase)


def test_records_count_korthikanti_flops():
    """Per layer and microbatch (GPT, unfused attention): forward 24 b s h^2 + 4 b s^2 h FLOPs, backward twice that;
    full recompute adds one forward, selective adds the attention core's 4 b s^2 h."""
    gpt = Transformer("gpt", 1024, 16, 2, 512, 1024, attention="unfused")
    b, s, h = 2, 512, 1024
    ops = records.layer_ops(gpt, b, 1, False, "none")
    assert _flops(ops, "fwd") == 24 * b * s * h * h + 4 * b * s * s * h
    assert _flops(ops, "bwd") == 2 * _flops(ops, "fwd")
    assert _flops(records.layer_ops(gpt, b, 1, False, "full"), "recompute") == _flops(ops, "fwd")
    assert _flops(records.layer_ops(gpt, b, 1, False, "sel"), "recompute") == 4 * b * s * s * h
    tp = records.layer_ops(gpt, b, 4, False, "none")
    assert _flops(tp, "fwd") == _flops(ops, "fwd") // 4


def test_records_tensor_parallel_collectives():
    """Korthikanti's counts: tensor parallelism all-reduces twice in forward and twice in backward; sequence
    parallelism replaces each by an all-gather and a reduce-scatter (plus Megatron's re-gather of the input for
    the weight gradient)."""
    gpt = Transformer("gpt", 1024, 16, 2, 512, 1024)
    kinds = lambda ops, phase: sorted(op.shape[0] for op in ops if op.kind == "collective" and op.phase == phase)  # noqa
    tp = records.layer_ops(gpt, 1, 4, False, "none")
    assert kinds(tp, "fwd") == ["all_reduce"] * 2 and kinds(tp, "bwd") == ["all_reduce"] * 2
    sp = records.layer_ops(gpt, 1, 4, True, "none")
    assert kinds(sp, "fwd") == ["all_gather"] * 2 + ["reduce_scatter"] * 2
    assert kinds(sp, "bwd") == ["all_gather"] * 4 + ["reduce_scatter"] * 2
    assert kinds(records.layer_ops(gpt, 1, 4, False, "full"), "recompute") == ["all_reduce"] * 2


@pytest.mark.parametrize("tp,sp,recompute,expected", [
    (1, False, "none", lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h)),
    (8, False, "none", lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    (8, True, "none", lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h)),
    (8, True, "sel", lambda s, b, h, a, t: s * b * h * 34 / t),
    (8, False, "full", lambda s, b, h, a, t: 2 * s * b * h),
    (8, True, "full", lambda s, b, h, a, t: 2 * s * b * h / t),
])
def test_activation_bytes_are_korthikantis(tp, sp, recompute, expected):
    gpt = Transformer("gpt-175b", 12288, 96, 96, 2048, 51200, attention="unfused", dropout=True)
    s, b, h, a = 2048, 1, 12288, 96
    assert memory.layer_activation_bytes(gpt, b, tp, sp, recompute) == pytest.approx(expected(s, b, h, a, tp), rel=1e-9)


def test_one_stage_step_is_its_microbatches_and_optimizer(table_path):
    """pp 1, one GPU: the step is micro x (forward + backward) of every record, plus the optimizer."""
    gpt = Transformer("gpt", 1024, 16, 4, 512, 8192, attention="flash", dropout=False)
    t = h200_tables(table_path)
    fw = dataclasses.replace(FRAMEWORKS["paddle"], launch_s=0.0, collective_latency_s=0.0)
    e = estimate(gpt, parse("tp1pp1mb2rcnone"), hardware.cluster(hardware.gpu_named("h200"), 1), t, 8, fw)
    ops = [op for _ in range(gpt.layers) for op in records.layer_ops(gpt, 2, 1, False, "none")]
    ops += records.embedding_ops(gpt, 2, 1, False) + records.head_ops(gpt, 2, 1, False)

    def seconds(op):
        if op.kind == "gemm":
            return 2 * op.shape[0] * op.shape[1] * op.shape[2] / GEMM_RATE
        if op.kind == "memory":
            return op.shape[0] / MEMORY_RATE
        bh, s, d = op.shape
        flops = 4 * bh * s * s * d * 0.5
        return (2.5 if op.what.endswith("bwd") else 1.0) * flops / ATTENTION_RATE

    n = gpt.layers * gpt.layer_params + gpt.embedding_params
    per_micro = sum(seconds(op) for op in ops) + fw.accumulate_bytes * n / MEMORY_RATE
    n = gpt.layers * gpt.layer_params + gpt.embedding_params
    optimizer = n / ADAMW_RATE + (4 * n + 6 * n + 4 * n) / MEMORY_RATE
    assert e.step_time_s == pytest.approx(4 * per_micro + optimizer, rel=1e-6)
    assert e.breakdown["pipeline_bubble_s"] == pytest.approx(0.0, abs=1e-9)


def test_no_kernel_is_faster_than_its_launch(table_path):
    """With a launch floor of 1 s every kernel costs 1 s: the step is the microbatches' kernel count."""
    gpt = Transformer("gpt", 256, 4, 2, 256, 1024, attention="flash", dropout=False)
    t = h200_tables(table_path)
    fw = dataclasses.replace(FRAMEWORKS["paddle"], launch_s=1.0, collective_latency_s=0.0, accumulate_bytes=0)
    e = estimate(gpt, parse("tp1pp1mb1rcnone"), hardware.cluster(hardware.gpu_named("h200"), 1), t, 3, fw)
    ops = [op for _ in range(gpt.layers) for op in records.layer_ops(gpt, 1, 1, False, "none")]
    ops += records.embedding_ops(gpt, 1, 1, False) + records.head_ops(gpt, 1, 1, False)
    assert e.breakdown["compute_s"] == pytest.approx(3 * len(ops), rel=1e-9)


@pytest.mark.parametrize("layout,gpus,batch", [("tp8pp8mb1rcsel", 64, 517), ("sp8pp8vp3mb1rcsel", 64, 520),
                                               ("tp4pp4vp2dp2mb1rcnone", 32, 246), ("tp8pp16mb2rcfull", 128, 900)])
def test_a_long_pipeline_extrapolated_equals_its_whole_simulation(layout, gpus, batch, monkeypatch):
    """Past its warm-up a schedule adds the same time per round of microbatches: two short simulations of the same
    residue modulo the stages, extrapolated, give every stage's end of the whole one (first and last stages
    heavier: embedding, head)."""
    import importlib

    estimate_module = importlib.import_module("paddle_hybrid.plan.estimate")
    gpu = hardware.gpu_named("a100-80g")
    model = dataclasses.replace(PRESETS["gpt-175b"], layers=96)
    args = (model, parse(layout), hardware.cluster(gpu, gpus), tables.load(gpu), batch, FRAMEWORKS["megatron"])
    monkeypatch.setattr(estimate_module, "MANY_EVENTS", 10 ** 9)
    whole = estimate_module.estimate(*args)
    monkeypatch.setattr(estimate_module, "MANY_EVENTS", 100)
    short = estimate_module.estimate(*args)
    assert len(short.timeline.events) < len(whole.timeline.events)
    for a, b in zip(whole.per_stage, short.per_stage):
        assert b["step_s"] == pytest.approx(a["step_s"], rel=1e-12)
        assert b["peak_bytes"] == a["peak_bytes"]


def test_sharding_stage_2_reduces_every_microbatch(table_path):
    """Stage 1 reduce-scatters the step's gradients once; stage 2 keeps only its share, so every microbatch's are
    reduce-scattered (with a pipeline fleet's profile hides neither behind a backward); both all-gather the
    updated parameters once."""
    gpt = Transformer("gpt", 1024, 16, 4, 512, 8192, attention="flash", dropout=False)
    t = h200_tables(table_path)
    clus = hardware.cluster(hardware.gpu_named("h200"), 16)
    fw = dataclasses.replace(FRAMEWORKS["paddle"], launch_s=0.0, collective_latency_s=0.0)
    one = estimate(gpt, parse("tp1pp2sharding8mb1rcnone"), clus, t, 32, fw)   # 4 microbatches a replica
    two = estimate(gpt, parse("tp1pp2sharding8s2mb1rcnone"), clus, t, 32, fw)
    model = comm.CommModel(clus)
    where = comm.place(fw.order, {"tp": 1, "pp": 2, "dp": 1, "sharding": 8}, "sharding", 8)
    for stage in (0, 1):
        params = 2 * gpt.layer_params + gpt.embedding_params  # each stage: 2 layers and a copy of the tied embedding
        scatter, gather = model.reduce_scatter(4 * params, where), model.all_gather(2 * params, where)
        tied = one.per_stage[stage]["dp_comm_s"] - scatter - gather  # the tied embedding's all-reduce, alike in both
        assert tied > 0
        assert two.per_stage[stage]["dp_comm_s"] == pytest.approx(4 * scatter + gather + tied, rel=1e-9)
        assert one.per_stage[stage]["gradients_bytes"] == 8 * two.per_stage[stage]["gradients_bytes"]
