"""Legacy static programs for the tests and benchmarks of the static features: comparing
programs op for op (:func:`program_signature`), building small auto-parallel programs the way
Paddle's ``test_auto_parallel_reshard*.py`` do, and pipeline section programs built by Paddle's
``PipelineOptimizer`` on a CPU build (no execution).

Build everything under ``paddle.pir_utils.OldIrGuard()``.
"""
from __future__ import annotations

import contextlib

import numpy as np
import paddle
from paddle import nn
from paddle.base import framework, unique_name
from paddle.base.backward import append_backward
from paddle.base.layer_helper import LayerHelper

__all__ = ["program_signature", "dist_signature", "process_groups", "build_auto_parallel_program", "run_reshard",
           "build_pipeline_program", "pipeline_places_on_cpu"]

# Attributes that record where an op was built (Python stack), not what it does.
_PROVENANCE_ATTRS = {"op_callstack", "op_namescope", "with_quant_attr"}


def _attr(value):
    if isinstance(value, framework.Block):
        return ("block", value.idx)
    if isinstance(value, (list, tuple)):
        return tuple(_attr(v) for v in value)
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def program_signature(program):
    """Per block: ops (type, inputs, outputs, attrs) and vars (name, type, shape,
    dtype, persistable, stop_gradient).  Two programs with equal signatures hold
    the same ops in the same order on the same variables."""
    blocks = []
    for block in program.blocks:
        ops = []
        for op in block.ops:
            ops.append((
                op.type,
                tuple((n, tuple(op.input(n))) for n in sorted(op.input_names)),
                tuple((n, tuple(op.output(n))) for n in sorted(op.output_names)),
                tuple(sorted((k, _attr(v)) for k, v in op.all_attrs().items()
                             if k not in _PROVENANCE_ATTRS)),
            ))
        vars_ = []
        for name in sorted(block.vars):
            v = block.vars[name]
            shape = tuple(v.shape) if v.type == paddle.base.core.VarDesc.VarType.LOD_TENSOR else None
            dtype = v.dtype if v.type == paddle.base.core.VarDesc.VarType.LOD_TENSOR else None
            vars_.append((name, str(v.type), shape, str(dtype), v.persistable, v.stop_gradient))
        blocks.append((block.idx, block.parent_idx, tuple(ops), tuple(vars_)))
    return tuple(blocks)


def _mesh(mesh):
    return None if mesh is None else (tuple(mesh.shape), tuple(mesh.process_ids))


def dist_signature(program, dist_context):
    """The distributed attributes of every op and var of ``program``."""
    out = []
    for block in program.blocks:
        for op in block.ops:
            attr = dist_context.get_op_dist_attr_for_program(op)
            if attr is None:
                out.append((op.type, None))
                continue
            out.append((
                op.type,
                _mesh(attr.process_mesh),
                attr.impl_type,
                attr.impl_idx,
                tuple((n, tuple(attr.get_input_dims_mapping(n) or ())) for n in sorted(op.input_arg_names)),
                tuple((n, tuple(attr.get_output_dims_mapping(n) or ())) for n in sorted(op.output_arg_names)),
            ))
        for name in sorted(block.vars):
            attr = dist_context.get_tensor_dist_attr_for_program(block.vars[name])
            out.append((name, None if attr is None else (_mesh(attr.process_mesh), tuple(attr.dims_mapping))))
    return tuple(out)


def _gelu(x):
    # 3.3.1's F.gelu no longer accepts legacy Variables: append the op directly.
    helper = LayerHelper("gelu")
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op(type="gelu", inputs={"X": x}, outputs={"Out": out}, attrs={"approximate": True})
    return out


def build_auto_parallel_program(rank, *, dp=1, mp=1, pp=2, layers=2, hidden=16, batch=4, layer_norm=False,
                                stress=False):
    """A stack of MLP blocks (optional LayerNorm, column-split Linear, gelu,
    row-split Linear) on ``pp`` stage meshes of shape ``[dp, mp]``, contiguous
    runs of blocks per stage, completed, differentiated, partitioned for
    ``rank`` and given Adam update ops, as Paddle's reshard tests do.

    ``stress`` makes reshard insert many ops (the benchmark's case): block
    ``i``'s column-split half sits on stage ``2i % pp`` and its row half on
    stage ``(2i + 1) % pp``, on that stage's mesh transposed (shape
    ``[mp, dp]``) with a replicated weight, so every block boundary gathers
    all ``mp`` pieces (a recv and a concat per piece) and scatters gradients back.

    Process groups are reset first, so two calls with the same arguments give
    the same ring ids.  Returns ``(main, startup, dist_context,
    dist_params_grads)``; call :func:`run_reshard` on them.
    """
    from paddle.distributed.auto_parallel.static.completion import Completer
    from paddle.distributed.auto_parallel.static.dist_context import DistributedContext
    from paddle.distributed.auto_parallel.static.partitioner import Partitioner
    from paddle.distributed.auto_parallel.static.process_group import clear_all_process_groups
    from paddle.distributed.fleet import auto

    if not 0 <= rank < dp * mp * pp:
        raise ValueError(f"rank {rank} is outside the {dp}x{mp}x{pp} cluster")
    clear_all_process_groups()
    names = ["dp", "mp"]
    ids = np.arange(dp * mp * pp).reshape(pp, dp, mp)
    meshes = [auto.ProcessMesh(ids[s].tolist(), dim_names=names) for s in range(pp)]
    row_meshes = [auto.ProcessMesh(ids[s].T.tolist(), dim_names=names[::-1]) for s in range(pp)] \
        if stress else meshes
    batch_split = ["dp", None] if dp > 1 else [None, None]
    col = [None, "mp"] if mp > 1 else [None, None]
    row = ["mp", None] if mp > 1 and not stress else [None, None]

    main, startup = framework.Program(), framework.Program()
    dist_context = DistributedContext()
    dist_context.process_mesh = auto.ProcessMesh(ids.tolist(), dim_names=["pp"] + names)
    with framework.program_guard(main, startup), unique_name.guard():
        x = paddle.static.data(name="input", shape=[batch, hidden], dtype="float32")
        label = paddle.static.data(name="label", shape=[batch, hidden], dtype="float32")
        auto.shard_tensor(x, meshes[0], batch_split)
        auto.shard_tensor(label, meshes[-1], batch_split)
        out = x
        for i in range(layers):
            stage = (2 * i) % pp if stress else i * pp // layers
            row_stage = (2 * i + 1) % pp if stress else stage
            mesh = meshes[stage]
            if layer_norm:
                ln = nn.LayerNorm(hidden)
                auto.shard_tensor(ln.weight, mesh, [None])
                auto.shard_tensor(ln.bias, mesh, [None])
                out = ln(out)
            l0, l1 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
            auto.shard_tensor(l0.weight, mesh, col)
            auto.shard_tensor(l1.weight, row_meshes[row_stage], row)
            out = l1(_gelu(l0(out)))
        loss = paddle.mean(paddle.nn.functional.square_error_cost(out, label))

    completer = Completer(dist_context)
    main = completer.complete_forward_annotation(main)
    dist_context.block_state.parse_forward_blocks(main)
    with framework.program_guard(main, startup):
        params_grads = append_backward(loss, distop_context=dist_context.dist_op_context)
    completer.complete_backward_annotation(main)
    dist_context.block_state.parse_backward_blocks(main)
    dist_main, dist_startup, dist_params_grads = Partitioner(dist_context, rank).partition(
        main, startup, params_grads)
    with framework.program_guard(dist_main, dist_startup), unique_name.guard("opt_"):
        optimizer = paddle.optimizer.Adam(0.01)
        optimizer.apply_gradients(dist_params_grads)
    dist_context._serial_optimizer = optimizer
    Completer(dist_context).complete_update_annotation(dist_main)
    return dist_main, dist_startup, dist_context, dist_params_grads


def run_reshard(rank, main, startup, dist_context, dist_params_grads):
    """``Resharder(...).reshard()`` on a program from :func:`build_auto_parallel_program`,
    with fresh unique-name counters (so two runs name new variables alike: reshard's
    ``LayerHelper`` also counts names on the *default* main program, hence the guard)."""
    from paddle.distributed.auto_parallel.static.reshard import Resharder

    with unique_name.guard(), framework.program_guard(framework.Program(), framework.Program()):
        Resharder(main, startup, rank, dist_context, dist_params_grads).reshard()


def process_groups():
    """(id, ranks, type) of every auto-parallel process group, in creation order."""
    from paddle.distributed.auto_parallel.static.process_group import get_all_process_groups

    return tuple((g.id, tuple(g.ranks), g.group_type) for g in get_all_process_groups())


@contextlib.contextmanager
def pipeline_places_on_cpu():
    """Let ``PipelineOptimizer.minimize`` finish on a CPU build.

    Its last step indexes ``place_list``, which it fills only when Paddle is
    compiled with CUDA; everything before (the section program) is built
    already.  Inside this context the pipeline module sees a ``core`` whose
    ``is_compiled_with_cuda()`` is True and whose ``CUDAPlace`` is a CPUPlace: the static_pipeline
    component's device answer, made here through a patcher of its own (the component answers
    only inside its ``minimize`` wrapper, and may be off).  Restored on exit.
    """
    import paddle.incubate.optimizer.pipeline as pipeline_module

    from ..registry import device
    from ..registry.patching import Patcher
    from ..static.static_pipeline import CPU_PLACE_ANSWERS

    patcher = Patcher("paddle_hybrid.testing.pipeline_places_on_cpu", "PADDLE_HYBRID_STATIC_PIPELINE=off")
    patcher.answer(pipeline_module, "core", CPU_PLACE_ANSWERS, when=lambda: not device.cuda_build(),
                   why="pipeline_places_on_cpu")
    try:
        yield
    finally:
        patcher.revert()


def build_pipeline_program(stage, *, stages=2, schedule="1F1B", recompute=False, branches=1, width=8,
                           micro_batch=2, microbatches=2, upstream_send_sync_opt=True):
    """The section program of ``stage`` built by Paddle's ``PipelineOptimizer``
    (what fleet's pipeline meta optimizer drives), without executing anything.

    The model has ``branches`` parallel chains of ``fc`` layers, one layer per
    chain on each of ``stages`` stages, so each stage but the last sends
    ``branches`` activations forward (``fc`` outputs that the stage's own
    backward never reads).  ``recompute`` wraps the optimizer in
    ``RecomputeOptimizer`` with the stage outputs as checkpoints.
    ``upstream_send_sync_opt=False`` switches off upstream's
    ``_optimize_forward_send_sync`` (1F1B programs then keep their
    ``c_sync_comm_stream`` per forward send).  Build under ``OldIrGuard``.
    """
    from paddle.incubate.optimizer import PipelineOptimizer, RecomputeOptimizer

    main, startup = framework.Program(), framework.Program()
    with framework.program_guard(main, startup), unique_name.guard():
        x = paddle.static.data("x", [micro_batch, width], "float32")
        y = paddle.static.data("y", [micro_batch, width], "float32")
        hs, checkpoints = [x] * branches, []
        for s in range(stages):
            with paddle.static.device_guard(f"gpu:{s}"):
                hs = [paddle.static.nn.fc(h, width) for h in hs]
                checkpoints.extend(hs)
        with paddle.static.device_guard(f"gpu:{stages - 1}"):
            total = hs[0]
            for h in hs[1:]:
                total = total + h
            loss = paddle.mean((total - y) ** 2)
        optimizer = paddle.optimizer.SGD(0.1)
        if recompute:
            sgd, optimizer = optimizer, RecomputeOptimizer(optimizer)
            optimizer._set_checkpoints(checkpoints[: -branches])
            optimizer.inner_opt = sgd  # as fleet's meta-optimizer chain does: PipelineOptimizer unwraps it
        optimizer = PipelineOptimizer(optimizer, num_microbatches=microbatches)
        main._pipeline_opt = {
            "local_rank": stage, "schedule_mode": schedule, "micro_batch_size": micro_batch,
            "ring_id": 20, "global_ring_id": 1, "use_sharding": False, "mp_degree": 1, "mp_rank": 0,
        }
        saved = PipelineOptimizer._optimize_forward_send_sync
        if not upstream_send_sync_opt:
            PipelineOptimizer._optimize_forward_send_sync = lambda self, program: None
        try:
            with pipeline_places_on_cpu():
                optimizer.minimize(loss, startup)
        finally:
            PipelineOptimizer._optimize_forward_send_sync = saved
    return main._pipeline_opt["section_program"]
