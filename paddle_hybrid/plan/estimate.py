"""One layout's step on a cluster, estimated: each pipeline stage's kernels priced from measured tables,
its communication by where its groups sit, the schedule simulated per rank, the step the slowest rank's.

Phases of :func:`estimate`:

1. **stages**: which layers each (stage, chunk) holds; the first chunk of stage 0 also the embedding, the
   last chunk of the last stage the final norm, LM head and loss;
2. **per microbatch**: each chunk's forward and backward seconds from its records (:mod:`.records`):
   kernels from the tables, tensor-parallel collectives on the critical path (the input-gradient
   all-reduce hidden behind the weight-gradient GEMM where the framework overlaps them);
3. **memory** (before the schedule, so a layout that cannot fit need not be simulated): states, the activations
   the stage's order keeps in flight at its worst, the largest temporary (allocated); the allocator's
   fragmentation and the context on top (the device's);
4. **schedule**: every stage's order (1F1B, interleaved or F-then-B as fleet runs them) simulated with the
   point-to-point messages between stages (:mod:`.simulate`), a long one extrapolated from two short ones;
5. **after the pipeline**: the data-parallel gradient reduce (or sharding's reduce-scatter and
   all-gather; stage 2 every microbatch's), exposed except where the framework overlaps it with a backward;
   tied embeddings' all-reduce between the first and last stage; the optimizer.
"""
from __future__ import annotations

import dataclasses

from ..common import schedule
from . import comm as comm_model
from . import memory as mem
from .records import embedding_ops, head_ops, layer_ops
from .simulate import simulate

__all__ = ["Framework", "FRAMEWORKS", "Estimate", "estimate"]


# The two knobs not read from a table: fitted by ``benchmarks/bench_plan.py --fit`` on the even rows of vTrain's
# 1440 measured A100 runs (docs/plan.md: the fit and the error on the rows and sets it did not see).  Paddle's
# dygraph is given Megatron's (PyTorch eager) values: not measured.
FITTED = {"launch_s": 100e-6, "collective_latency_s": 50e-6}


@dataclasses.dataclass(frozen=True)
class Framework:
    """How a training framework runs a layout, where it changes the step."""
    name: str
    order: tuple                 # rank order of the axes, slowest first
    tp_dgrad_overlap: bool       # input-gradient all-reduce overlapped with the weight-gradient GEMM
    dp_overlap: str              # "never" | "no_pp" (only without a pipeline) | "always": reduce during last backward
    p2p_split_by_tp: bool        # pipeline messages scattered over the tensor-parallel ranks
    schedule: str = "1f1b"       # 1f1b | fthenb  (interleaved whenever vp > 1)
    cast_bytes: int = 0          # bytes a parameter moves each microbatch's forward (autocast's bf16 copy)
    accumulate_bytes: int = 0    # ... each microbatch's backward (a bf16 gradient added into a float32 one)
    attention_backend: str = "flash"  # flash (FlashAttention-2) | cudnn (cuDNN fused attention)
    launch_s: float = 0.0        # the host's time to issue one kernel: no kernel takes less on the step's path
    collective_latency_s: float = 0.0  # fixed cost of a collective beyond its bytes (host, NCCL launch)


FRAMEWORKS = {
    # Megatron-LM as Korthikanti et al. 2022 and vTrain ran it: tp fastest, then dp, then pp; async
    # tensor-parallel all-reduce; gradient all-reduce after the backward; scatter-gather pipeline messages.
    # Megatron-Core with Transformer Engine runs cuDNN's fused attention on Hopper.
    "megatron": Framework("megatron", ("pp", "dp", "tp"), True, "never", True, attention_backend="cudnn",
                          launch_s=FITTED["launch_s"], collective_latency_s=FITTED["collective_latency_s"]),
    # fleet's hybrid topology (dp, pp, sharding, sep, mp: mp fastest); fleet's DataParallel reduces in buckets
    # during backward, its pipeline after the last microbatch; no async tensor-parallel all-reduce by default.
    "paddle": Framework("paddle", ("dp", "pp", "sharding", "tp"), False, "no_pp", False, accumulate_bytes=10,
                        launch_s=FITTED["launch_s"], collective_latency_s=FITTED["collective_latency_s"]),
    # PyTorch eager with autocast, as benchmarks/bench_gpu_tables.py times its steps on one GPU: float32 weights
    # cast to bf16 in every microbatch's forward, bf16 weight gradients accumulated into float32 ones.
    "torch_autocast": Framework("torch_autocast", ("dp", "pp", "tp"), False, "never", False, cast_bytes=6,
                                accumulate_bytes=10, launch_s=FITTED["launch_s"],
                                collective_latency_s=FITTED["collective_latency_s"]),
}


@dataclasses.dataclass
class Estimate:
    layout: object
    step_time_s: float
    breakdown: dict
    peak_bytes_per_gpu: int
    memory: dict
    fits: bool
    tokens_per_s: float
    mfu: float
    slowest_stage: int
    per_stage: list
    notes: list
    timeline: object = None      # the simulated pipeline (simulate.Timeline), for pictures

    def as_json(self) -> dict:
        return {"layout": self.layout.name(), "step_time_s": self.step_time_s, "fits": self.fits,
                "peak_bytes_per_gpu": self.peak_bytes_per_gpu, "mfu": self.mfu, "tokens_per_s": self.tokens_per_s,
                "breakdown": self.breakdown, "memory": self.memory, "slowest_stage": self.slowest_stage}


# --------------------------------------------------------------------------- pricing records

def _price(ops, tables, comm, tp_place, fw, overlap_dgrad):
    """{phase: (compute seconds, exposed tensor-parallel seconds)} of a list of records."""
    out = {}
    backend = fw.attention_backend if tables.has_attention(fw.attention_backend) else "flash"
    # A linear's backward collective hides behind the other GEMM of its backward: the input gradient's all-reduce
    # (reduce-scatter) behind the weight gradient, SP's re-gathered input behind the input gradient.
    hiding = {}
    for op in ops:
        if op.kind == "gemm" and op.phase == "bwd" and op.what.endswith((".wgrad", ".dgrad")):
            name, part = op.what.rsplit(".", 1)
            hiding[(name, "dgrad" if part == "wgrad" else "wgrad")] = tables.gemm(*op.shape)
    for op in ops:
        compute, exposed = out.get(op.phase, (0.0, 0.0))
        if op.kind == "gemm":
            compute += max(tables.gemm(*op.shape), fw.launch_s)
        elif op.kind == "attention":
            fwd, bwd = tables.attention(*op.shape, causal=True, backend=backend)
            compute += max(bwd if op.what.endswith(".bwd") else fwd, fw.launch_s)
        elif op.kind == "memory":
            compute += max(tables.memory_bound(op.shape[0]), fw.launch_s)
        else:
            kind, nbytes, _axis = op.shape
            seconds = getattr(comm, kind)(nbytes, tp_place) + fw.collective_latency_s
            name, part = op.what.rsplit(".", 1) if "." in op.what else (op.what, "")
            hidden_by = hiding.get((name, part.split("_")[0])) if overlap_dgrad and op.phase == "bwd" else None
            if hidden_by is not None:
                seconds = max(0.0, seconds - hidden_by)
            exposed += seconds
        out[op.phase] = (compute, exposed)
    return out


def _fwd_bwd(priced):
    f = priced.get("fwd", (0.0, 0.0))
    b = priced.get("bwd", (0.0, 0.0))
    r = priced.get("recompute", (0.0, 0.0))
    return {"f_compute": f[0], "f_comm": f[1], "b_compute": b[0] + r[0], "b_comm": b[1] + r[1]}


# --------------------------------------------------------------------------- phases

def _chunk_costs(model, layout, mbs, recompute, tables, comm, tp_place, fw):
    """{(stage, chunk): costs of one microbatch} (phase 1 and 2)."""
    chunks = layout.pp * layout.vp
    per_chunk = model.layers // chunks
    layer = _fwd_bwd(_price(layer_ops(model, mbs, layout.tp, layout.sp, recompute), tables, comm, tp_place, fw,
                            fw.tp_dgrad_overlap))
    first = _fwd_bwd(_price(embedding_ops(model, mbs, layout.tp, layout.sp), tables, comm, tp_place, fw, False))
    last = _fwd_bwd(_price(head_ops(model, mbs, layout.tp, layout.sp), tables, comm, tp_place, fw,
                           fw.tp_dgrad_overlap))
    per_param_f = tables.memory_bound(fw.cast_bytes * model.layer_params // layout.tp)
    per_param_b = tables.memory_bound(fw.accumulate_bytes * model.layer_params // layout.tp)
    layer["f_compute"] += per_param_f
    layer["b_compute"] += per_param_b
    emb = model.embedding_params // layout.tp
    first["f_compute"] += tables.memory_bound(fw.cast_bytes * emb)
    first["b_compute"] += tables.memory_bound(fw.accumulate_bytes * emb)
    if not model.tied or layout.pp > 1:
        last["f_compute"] += tables.memory_bound(fw.cast_bytes * emb)
        last["b_compute"] += tables.memory_bound(fw.accumulate_bytes * emb)
    costs = {}
    for virtual in range(chunks):
        stage, chunk = virtual % layout.pp, virtual // layout.pp
        c = {k: v * per_chunk for k, v in layer.items()}
        for extra, on in ((first, virtual == 0), (last, virtual == chunks - 1)):
            if on:
                c = {k: c[k] + extra[k] for k in c}
        costs[(stage, chunk)] = c
    return costs


def _orders(layout, micro, fw):
    if layout.vp > 1:
        return [schedule.interleaved(layout.pp, micro, layout.vp, s) for s in range(layout.pp)]
    if fw.schedule == "fthenb":
        return [schedule.f_then_b(micro) for _ in range(layout.pp)]
    return [schedule.one_f_one_b(layout.pp, micro, s) for s in range(layout.pp)]


# A pipeline of more microbatches than this (and over MANY_EVENTS ops) is simulated at two shorter lengths of the
# same residue modulo the stages (fleet's interleaved order depends on it) and each stage's end extrapolated: past
# its warm-up a schedule's steady state adds the same time for every further round of microbatches.
MANY_EVENTS = 20000


def _pipeline(layout, micro, fw, duration, p2p):
    """(the simulated timeline, ``{stage: when its last backward ends}``); the timeline is of fewer microbatches
    where the step's were extrapolated (:data:`MANY_EVENTS`)."""
    p = layout.pp
    short = 2 * p + micro % p
    if 2 * micro * p * layout.vp <= MANY_EVENTS or micro <= short + p:
        timeline = simulate(_orders(layout, micro, fw), duration, p2p)
        return timeline, _ends(timeline, p)
    first = simulate(_orders(layout, short, fw), duration, p2p)
    second = simulate(_orders(layout, short + p, fw), duration, p2p)
    a, b = _ends(first, p), _ends(second, p)
    rounds = (micro - short) / p
    return first, {s: a[s] + rounds * (b[s] - a[s]) for s in range(p)}


def _textbook_ends(layout, micro, costs, p2p_s):
    """Every stage's pipeline end without a simulation: the slowest chunk's forward and backward ``micro x vp``
    times, plus ``pp - 1`` of them and of the messages both ways (the bubble of 1F1B; interleaving's smaller one
    with chunks that are ``vp`` times smaller)."""
    per_op = max(c["f_compute"] + c["f_comm"] + c["b_compute"] + c["b_comm"] for c in costs.values())
    message = max(p2p_s.values(), default=0.0) if layout.pp > 1 else 0.0
    end = (micro * layout.vp + layout.pp - 1) * per_op + 2 * (layout.pp - 1) * message
    return {s: end for s in range(layout.pp)}


def _ends(timeline, stages):
    ends = {s: 0.0 for s in range(stages)}
    for e in timeline.events:
        ends[e.rank] = max(ends[e.rank], e.end)
    return ends


def _in_flight(order):
    """``{chunk: microbatches of that chunk held}`` at the moment the rank running ``order`` holds the most
    (forwards whose backward has not run yet)."""
    held, worst, worst_counts = {}, -1, {}
    for action in order:
        c = action.chunk or 0
        held[c] = held.get(c, 0) + (1 if action.kind == schedule.FORWARD else -1)
        total = sum(held.values())
        if total > worst:
            worst, worst_counts = total, dict(held)
    return worst_counts


def _memory(model, layout, stage, params, order, mbs, recompute) -> dict:
    """Phase 5 for one stage: its states, the activations its order holds at its worst moment, the largest
    temporary; allocated, and on the device."""
    counts = _in_flight(order)
    states = mem.state_bytes_per_param(layout.stage if layout.sharding > 1 else 1, layout.sharding)
    state_bytes = {k: int(v * params) for k, v in states.items()}
    per_layer = mem.layer_activation_bytes(model, mbs, layout.tp, layout.sp, recompute)
    chunk_layers = model.layers // (layout.pp * layout.vp)
    acts = sum(n * per_layer * chunk_layers for n in counts.values())
    tokens = mbs * model.seq
    if stage == 0:
        acts += counts.get(0, 0) * tokens * model.hidden * 3 // (layout.tp if layout.sp else 1)
    temporary = per_layer
    if stage == layout.pp - 1:
        logits = tokens * model.vocab // layout.tp
        acts += counts.get(layout.vp - 1, 0) * logits * (2 + 4)
        temporary = max(temporary, logits * 4)
    allocated = sum(state_bytes.values()) + acts + temporary
    return {"peak_bytes": int(mem.device_bytes(allocated)), "allocated_bytes": int(allocated),
            "activations_bytes": int(acts), "in_flight": counts, **{f"{k}_bytes": v for k, v in state_bytes.items()}}


def _params_of_stage(model, layout, stage):
    layers = model.layers // layout.pp
    n = layers * model.layer_params // layout.tp
    if stage == 0:
        n += model.embedding_params // layout.tp
    if stage == layout.pp - 1 and (not model.tied or layout.pp > 1):
        n += model.embedding_params // layout.tp
    return n


def _data_parallel(params, layout, comm, cluster, fw, last_backward, micro):
    """(exposed seconds of the gradient reduce, seconds of sharding's parameter all-gather).  Sharding stage 2 and
    3 keep only their share of the gradients, so every microbatch's gradients are reduce-scattered, each during its
    own backward where the framework overlaps the reduce; stage 1 and plain data parallel reduce once a step."""
    place = lambda axis: comm_model.place(fw.order, {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp,  # noqa
                                                     "sharding": layout.sharding}, axis, cluster.gpus_per_node)
    overlap = fw.dp_overlap == "always" or (fw.dp_overlap == "no_pp" and layout.pp == 1)
    reduce_s = comm.all_reduce(4 * params, place("dp"))
    gather_s = 0.0
    if layout.sharding > 1:
        where = place("sharding")
        scatter_s = comm.reduce_scatter(4 * params, where)
        gather_s = comm.all_gather(2 * params, where)
        if layout.stage >= 2:
            per_micro = max(0.0, scatter_s - last_backward) if overlap else scatter_s
            return (max(0.0, reduce_s - last_backward) if overlap else reduce_s) + micro * per_micro, gather_s
        reduce_s += scatter_s
    exposed = max(0.0, reduce_s - last_backward) if overlap else reduce_s
    return exposed, gather_s


def _optimizer(params, layout, tables):
    shard = params // layout.sharding
    return (tables.adamw(shard) + tables.memory_bound(4 * params)      # the update; the global norm's read
            + tables.memory_bound(6 * shard) + tables.memory_bound(4 * params))  # bf16 copy of master; zero grads


def estimate(model, layout, cluster, tables, global_batch, fw=FRAMEWORKS["paddle"], stage_costs=None,
             simulate_unfit=True) -> Estimate:
    """The step of ``layout`` (its ``mbs`` and ``recompute`` given) for ``global_batch`` sequences.  ``stage_costs``
    (``{stage: {"f_compute", "f_comm", "b_compute", "b_comm"}}`` of one microbatch, e.g. priced from a dry run's
    recorded kernels) replaces phases 1-2 for the stages it names; a stage's chunks share its costs evenly.
    ``simulate_unfit=False``: a layout that does not fit the GPU's memory gets its pipeline's time from the
    textbook bubble instead of a simulation (a plan ranks those last; said in the notes)."""
    comm = comm_model.CommModel(cluster)
    degrees = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "sharding": layout.sharding}
    tp_place = comm_model.place(fw.order, degrees, "tp", cluster.gpus_per_node)
    mbs, recompute = layout.mbs, layout.recompute
    micro = global_batch // (layout.replicas * mbs)

    # phases 1-2: each chunk's microbatch
    costs = _chunk_costs(model, layout, mbs, recompute, tables, comm, tp_place, fw)
    for stage, given in (stage_costs or {}).items():
        for chunk in range(layout.vp):
            costs[(stage, chunk)] = {key: value / layout.vp for key, value in given.items()}

    # the schedule's messages and op times (phase 4 runs it)
    message = mbs * model.seq * model.hidden * 2 // (layout.tp if (fw.p2p_split_by_tp or layout.sp) else 1)
    pp_stride = comm_model.stride(fw.order, degrees, "pp")

    def node(stage):
        return stage * pp_stride // cluster.gpus_per_node

    p2p_s = {s: comm.p2p(message, node(s) == node((s + 1) % layout.pp)) + fw.collective_latency_s  # a NCCL call too
             for s in range(layout.pp)}

    def p2p(src, dst, action):  # a message crosses the boundary between stage min(src, dst) and the next
        low = min(src, dst) if abs(src - dst) == 1 else max(src, dst)   # the wrap from the last stage to stage 0
        return p2p_s[low]

    def duration(stage, action):
        c = costs[(stage, action.chunk or 0)]
        return (c["f_compute"] + c["f_comm"]) if action.kind == schedule.FORWARD else (c["b_compute"] + c["b_comm"])

    # phase 3: memory, first: a layout that cannot fit need not be simulated
    memory_orders = _orders(layout, min(micro, 2 * layout.pp + micro % layout.pp), fw)  # holds its worst early
    memories = [_memory(model, layout, stage, _params_of_stage(model, layout, stage), memory_orders[stage], mbs,
                        recompute) for stage in range(layout.pp)]
    fits = max(m["peak_bytes"] for m in memories) <= cluster.memory_bytes
    notes = []

    # phase 4: the schedule
    if fits or simulate_unfit:
        timeline, ends = _pipeline(layout, micro, fw, duration,
                                   p2p if layout.pp > 1 else (lambda src, dst, action: 0.0))
    else:
        timeline, ends = None, _textbook_ends(layout, micro, costs, p2p_s)
        notes.append("layouts that do not fit: pipeline time from the textbook bubble, not simulated")

    # phase 5: after the pipeline
    per_stage = []
    tied_s = 0.0
    if model.tied and layout.pp > 1:
        ends_share_a_node = node(0) == node(layout.pp - 1)
        tied_s = comm.all_reduce(4 * model.embedding_params // layout.tp,
                                 comm_model.Placement(2, 1, 2) if ends_share_a_node else comm_model.Placement(2, 2, 1))
    for stage in range(layout.pp):
        params = _params_of_stage(model, layout, stage)
        last_b = sum(costs[(stage, c)]["b_compute"] for c in range(layout.vp))
        dp_s, gather_s = _data_parallel(params, layout, comm, cluster, fw, last_b, micro)
        opt_s = _optimizer(params, layout, tables)
        end = ends[stage]
        tied_here = tied_s if stage in (0, layout.pp - 1) else 0.0
        total = end + dp_s + tied_here + opt_s + gather_s
        compute = sum(micro * (costs[(stage, c)]["f_compute"] + costs[(stage, c)]["b_compute"])
                      for c in range(layout.vp))
        tp_comm = sum(micro * (costs[(stage, c)]["f_comm"] + costs[(stage, c)]["b_comm"]) for c in range(layout.vp))

        per_stage.append({"stage": stage, "step_s": total, "pipeline_s": end, "compute_s": compute,
                          "tp_comm_s": tp_comm, "bubble_s": max(end - compute - tp_comm, 0.0),
                          "dp_comm_s": dp_s + tied_here + gather_s, "optimizer_s": opt_s, **memories[stage]})

    slow = max(per_stage, key=lambda s: s["step_s"])
    step = slow["step_s"]
    peak = max(s["peak_bytes"] for s in per_stage)
    tokens_step = global_batch * model.seq
    mfu = model.flops_per_token() * tokens_step / (step * cluster.gpus * cluster.gpu.peak_bf16_flops)
    breakdown = {"compute_s": slow["compute_s"], "tp_comm_exposed_s": slow["tp_comm_s"],
                 "pipeline_bubble_s": slow["bubble_s"], "dp_comm_exposed_s": slow["dp_comm_s"],
                 "optimizer_s": slow["optimizer_s"]}
    if tables.scaled_from:
        notes.append(f"kernel tables scaled from {tables.scaled_from} to {cluster.gpu.name} by peak and HBM ratios")
    if model.attention == "flash" and not tables.has_attention(fw.attention_backend):
        notes.append(f"no '{fw.attention_backend}' attention in the GPU table: attention priced as FlashAttention-2")
    if comm.scaled:
        notes.append(f"NVLink curve scaled from 8 x A100 (nccl-tests) by NVLink bandwidth to {cluster.gpu.name}")
    memory = {k: int(v) for k, v in slow.items() if k.endswith("_bytes")}
    return Estimate(layout, step, breakdown, peak, memory, fits, tokens_step / step, mfu, slow["stage"], per_stage,
                    notes, timeline)
