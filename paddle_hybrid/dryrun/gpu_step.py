"""The dry run's ``--gpu NAME``: the job's step priced on a named GPU cluster, per pipeline stage (each rank
class is a stage's) and for the job, by the step-time estimate of ``python -m paddle_hybrid.plan``.

The layout is the dry run's own (its degrees from the script's arguments), the micro-batch size, sequence
parallelism and recompute read from the script's arguments as for its degrees, the model's sizes from its
arguments or configuration (:func:`paddle_hybrid.plan.cli.model_of_script`).  Priced twice:

* before any run (:func:`price`), from the estimate's records of a decoder of those sizes: a layout the
  estimate cannot price (segment parallelism) is refused at once, and a run that records no kernels keeps it;
* after the runs (:func:`price_recorded`), each stage's microbatch from the kernels its class's run recorded
  (:mod:`paddle_hybrid.plan.recorded`) and its tensor-parallel collectives from its recorded calls: what the
  report shows (``gpu_step``), the first kept beside it (``gpu_step_from_shapes``).
"""
from __future__ import annotations

import dataclasses

from ..common.script_kind import flag_value
from ..plan import cli as plan_cli, comm as comm_model, hardware, recorded, tables as kernel_tables
from ..plan.estimate import FRAMEWORKS, estimate
from ..plan.layout import Layout

__all__ = ["job_layout", "price", "price_recorded", "Pricing", "table", "draw", "memory_gb", "RECORDS_NOTE",
           "RECORDED_NOTE"]

RECORDED_NOTE = ("GPU step: an ESTIMATE (python -m paddle_hybrid.plan's tables and schedule): each stage's "
                 "microbatch priced from the kernels its class's run recorded (forwards as run, backwards derived from "
                 "them; attention as the GPU job runs it) and its tensor-parallel collectives from its recorded calls "
                 "(split evenly between forward and backward); the pipeline, data-parallel reduce and optimizer as "
                 "the plan prices them")
RECORDS_NOTE = ("GPU step: an ESTIMATE (python -m paddle_hybrid.plan's): kernels written from the model's sizes "
                "(a LLaMA / GPT decoder), priced from tables measured on an H200; not the probe's record of this "
                "script's kernels")
_RECOMPUTE = {"none": "none", "full": "full", "selective": "sel", "core_attn": "sel", "full_attn": "full"}


def _optional_value(args: list, flag: str, bare: str, absent: str) -> str:
    """The value of an optional-argument flag (``nargs="?"``): ``--flag v`` / ``--flag=v``, ``bare`` when it is given
    without one, ``absent`` when it is not given; the last one wins."""
    found = absent
    for i, a in enumerate(args):
        if a == flag:
            nxt = args[i + 1] if i + 1 < len(args) else None
            found = bare if nxt is None or nxt.startswith("-") else nxt
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found


def memory_gb(gpu_name: str) -> float:
    """GB (1e9 bytes) of the named GPU's memory; ValueError for a GPU without tables."""
    return hardware.gpu_named(gpu_name).memory_bytes / 1e9


def job_layout(kind: str, args: list, degrees: dict, microbatches):
    """(Layout, global batch in sequences) of the script's own arguments; ValueError naming what it cannot take."""
    if degrees.get("sep", 1) > 1:
        raise ValueError(f"segment parallelism (sep {degrees['sep']}) is not priced by the step-time estimate")
    if kind == "flags":
        mbs = int(flag_value(args, "--micro-batch-size", 8))
        sp = "--sequence-parallel" in args
        recompute = _optional_value(args, "--recompute", bare="full", absent="none")
    elif kind == "trainer":
        mbs = int(flag_value(args, "--per_device_train_batch_size", 8))
        sp = str(flag_value(args, "--sequence_parallel", "false")).lower() in ("1", "true")
        on = str(flag_value(args, "--recompute", "false")).lower() in ("1", "true")
        recompute = str(flag_value(args, "--recompute_granularity", "full")) if on else "none"
    else:
        raise ValueError("a plain fleet script's micro-batch size is not read from its arguments")
    if recompute not in _RECOMPUTE:
        raise ValueError(f"recompute {recompute!r} is not priced (none, full, selective)")
    layout = Layout(tp=degrees["mp"], pp=degrees["pp"], vp=degrees.get("vp", 1), dp=degrees["dp"],
                    sharding=degrees["sharding"], sp=sp and degrees["mp"] > 1, mbs=mbs, recompute=_RECOMPUTE[recompute])
    return layout, mbs * int(microbatches or 1) * layout.replicas


def price(script: str, args: list, kind: str, degrees: dict, microbatches, gpu_name: str, nnodes: int,
          nproc_per_node: int, gpu_memory_gb=None, inter_node_gbps=None):
    """(the job's estimated step as the report keeps it: ``{"gpu", "layout", "step_time_s", "tokens_per_s", "mfu",
    "stages": [...], "error": measured error or None, "notes"}``, the estimate itself, the :class:`Pricing` the
    recorded kernels are priced with later); ValueError naming what it cannot price."""
    gpu = hardware.gpu_named(gpu_name)
    model = plan_cli.model_of_script(script, args)
    layout, global_batch = job_layout(kind, args, degrees, microbatches)
    clus = hardware.cluster(gpu, nnodes * nproc_per_node, nproc_per_node, inter_node_gbps, gpu_memory_gb)
    context = Pricing(model, layout, clus, kernel_tables.load(gpu), global_batch, FRAMEWORKS["paddle"])
    e = estimate(model, layout, clus, context.tables, global_batch, context.framework)
    return _result(context, e, RECORDS_NOTE), e, context


@dataclasses.dataclass
class Pricing:
    """What the job's step is priced with: kept from the check before any run to the report after them."""
    model: object
    layout: object
    cluster: object
    tables: object
    global_batch: int
    framework: object


def _result(context, e, how: str) -> dict:
    stages = [{k: s[k] for k in ("stage", "step_s", "compute_s", "tp_comm_s", "bubble_s", "dp_comm_s", "optimizer_s",
                                 "peak_bytes")} for s in e.per_stage]
    return {"gpu": context.cluster.gpu.name, "layout": context.layout.name(), "global_batch": context.global_batch,
            "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s, "mfu": e.mfu,
            "slowest_stage": e.slowest_stage, "stages": stages, "error": plan_cli.measured_error(context.cluster),
            "notes": [how] + e.notes}


def _tensor_parallel_seconds(entry, context) -> float:
    """One microbatch's tensor-parallel collectives, from the class's recorded calls on its model-parallel group
    (fleet's topology numbers mp fastest: the representative's group is its run of ``tp`` ranks)."""
    tp = context.layout.tp
    if tp <= 1:
        return 0.0
    rank = entry["representative"]
    group = [rank // tp * tp + i for i in range(tp)]
    comm = comm_model.CommModel(context.cluster)
    where = comm_model.place(context.framework.order, {"tp": tp, "pp": context.layout.pp, "dp": context.layout.dp,
                                                       "sharding": context.layout.sharding}, "tp",
                             context.cluster.gpus_per_node)
    seconds = 0.0
    for call in entry["communication"]:
        if call["group"] == group and call["calls"] and call["op"] in ("all_reduce", "all_gather", "reduce_scatter"):
            size = call["bytes"] / call["calls"] / 2  # a float32 tensor on the CPU, bf16 in the GPU job
            # the log's bytes are the call's first tensor: all_gather's input and reduce_scatter's output, this rank's
            # part of the whole tensor the collective is priced by
            whole = size * (tp if call["op"] in ("all_gather", "reduce_scatter") else 1)
            seconds += call["calls"] * (getattr(comm, call["op"])(whole, where) + context.framework.collective_latency_s)
    return seconds / max(entry.get("kernel_microbatches") or 1, 1)


def price_recorded(context: Pricing, entries: list):
    """(the result, the estimate) of the job's step with each stage's microbatch priced from the kernels its class's
    run recorded (:mod:`paddle_hybrid.plan.recorded`) and its tensor-parallel collectives from its recorded calls;
    None when no class recorded kernels."""
    stage_costs = {}
    for entry in entries:
        if not entry.get("kernels") or entry.get("stage") in stage_costs:
            continue
        priced = recorded.price_microbatch(entry["kernels"], entry.get("kernel_microbatches") or 1, context.tables,
                                           context.framework.launch_s, attention=context.model.attention,
                                           attention_backend=context.framework.attention_backend)
        tp_s = _tensor_parallel_seconds(entry, context)
        stage_costs[entry["stage"]] = {"f_compute": priced["fwd_s"], "b_compute": priced["bwd_s"],
                                       "f_comm": tp_s / 2, "b_comm": tp_s / 2}
    if not stage_costs:
        return None
    e = estimate(context.model, context.layout, context.cluster, context.tables, context.global_batch,
                 context.framework, stage_costs=stage_costs)
    return _result(context, e, RECORDED_NOTE), e


def table(result: dict) -> str:
    """The estimate as the dry run prints it."""
    lines = [f"GPU step on {result['gpu']} ({result['layout']}, global batch {result['global_batch']}): "
             f"{result['step_time_s']:.3f} s, {result['tokens_per_s']:.0f} tokens/s, MFU {result['mfu'] * 100:.1f} %"]
    error = result.get("error")
    lines.append("  an estimate; " + (f"its mean error on {error['runs']} unseen measured runs ({error['what']}): "
                                      f"{error['mean_abs_error'] * 100:.1f} %, worst {error['worst_abs_error'] * 100:.1f} %"
                                      if error else "no measured error on record"))
    lines.append(f"  {'stage':>5} {'step s':>8} {'compute':>8} {'tp comm':>8} {'bubble':>8} {'dp comm':>8} {'optim':>8}")
    for s in result["stages"]:
        lines.append(f"  {s['stage']:>5} {s['step_s']:>8.3f} {s['compute_s']:>8.3f} {s['tp_comm_s']:>8.3f} "
                     f"{s['bubble_s']:>8.3f} {s['dp_comm_s']:>8.3f} {s['optimizer_s']:>8.3f}")
    lines += [f"  note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def draw(step_estimate, path: str) -> bool:
    """The priced step's simulated timeline per stage, as a PNG."""
    from ..plan import pictures

    return pictures.step_timeline(step_estimate, path)
