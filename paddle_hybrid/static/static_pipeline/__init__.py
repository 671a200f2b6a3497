"""Fleet's legacy static pipeline (``strategy.pipeline``), trained by ``exe.run``.

A user script as Paddle's own static pipeline tests write it (stages under
``static.device_guard('gpu:N')``, a non-iterable ``DataLoader.from_generator`` yielding
micro-batches, ``fleet.distributed_optimizer(opt, strategy).minimize(loss)``, then
``exe.run(startup)`` and one ``exe.run(main, fetch_list=[loss])`` per step) trains with
``import paddle_hybrid``.  Three changes, each per call:

=============================================  ===============================================
Paddle                                          change
=============================================  ===============================================
``Executor.run``                                a program whose ``_pipeline_opt`` holds fleet's
                                                ``section_program`` runs that section with
                                                micro-batches (:mod:`.runner`); the startup
                                                program runs its stage's split startup program
``incubate PipelineOptimizer.minimize``         on a build without CUDA, during ``minimize``,
                                                the module's ``core`` answers that it has CUDA
                                                and that ``CUDAPlace`` is the CPU place, so its
                                                CUDA-only ``place_list`` holds the CPU place
``CollectiveHelper._init_communicator``         on a build without CUDA/XPU, called from fleet's
(and fleet ``PipelineOptimizer.                 pipeline optimizer: gloo rings, a store per
_init_process_group``, which marks the calls)   ring (:mod:`paddle_hybrid.gloo.rings`); other calls unchanged
=============================================  ===============================================

On CPU the executed copy of the section program has its ``send_v2``/``recv_v2`` lowered to
point-to-point messages on the rings' gloo process groups (:mod:`.lowering`).  Before the first
step the stages compare their pipeline settings through the job's store
(:meth:`.runner.SectionRunner.describe`), within the pipeline's deadline.

Device rule: the runner is device-independent (Paddle 3.3 lacks it on GPU too) but has only
executed on CPU.  ``PluginConfig.static_pipeline`` (``PADDLE_HYBRID_STATIC_PIPELINE``) is an
auto/on/off field of :mod:`paddle_hybrid.registry.gate`: ``"auto"`` installs on a build with no
accelerator and stays off on an accelerator build unless ``allow_unrun``, saying so; ``"on"``
opts in anywhere; ``"off"`` never.
"""
from __future__ import annotations

import functools
import threading

from ...registry import device
from ...registry.component import Component

__all__ = ["COMPONENT", "apply", "runner_for", "CPU_PLACE_ANSWERS"]

_RUNNER_ATTR = "_ph_section_runner"


# -- Executor.run ---------------------------------------------------------------------------

def runner_for(program, place, deadline=(None, None)):
    """The :class:`.runner.SectionRunner` of a fleet pipeline main program (one per program);
    ``deadline``: ``(seconds, setting)`` of the stages' agreement when it is made."""
    from .runner import SectionRunner

    runner = program.__dict__.get(_RUNNER_ATTR)
    if runner is None:
        import paddle

        lower = isinstance(place, paddle.CPUPlace) or not device.cuda_build()
        runner = SectionRunner(program, place, lower=lower, deadline=deadline)
        program.__dict__[_RUNNER_ATTR] = runner
    return runner


def _fetch_names(fetch_list):
    from paddle.base import framework

    if fetch_list is None:
        return []
    if not isinstance(fetch_list, (list, tuple)):
        fetch_list = [fetch_list]
    return [f.name if isinstance(f, framework.Variable) else str(f) for f in fetch_list]


def _make_run(original, deadline):
    @functools.wraps(original)
    def run(self, program=None, feed=None, fetch_list=None, feed_var_name="feed", fetch_var_name="fetch",
            scope=None, return_numpy=True, use_program_cache=False, use_prune=False):
        import paddle

        from .runner import is_pipeline_main, is_pipeline_startup

        if is_pipeline_startup(program):
            # Paddle 2.x ran the stage's split startup program; 3.3 would run every stage's.
            program = program._pipeline_opt["startup_program"]
        elif is_pipeline_main(program):
            if not return_numpy:
                raise NotImplementedError("paddle_hybrid.static.static_pipeline: return_numpy=False is not supported for "
                                          "pipeline programs (values are stacked per micro-batch).")
            scope = scope if scope is not None else paddle.static.global_scope()
            return runner_for(program, self.place, deadline).run(scope, feed, _fetch_names(fetch_list))
        return original(self, program, feed, fetch_list, feed_var_name, fetch_var_name, scope, return_numpy,
                        use_program_cache, use_prune)

    return run


# -- PipelineOptimizer.minimize -----------------------------------------------------------

_in_minimize = threading.local()


def _minimizing_without_cuda() -> bool:
    """While ``minimize`` runs on a build without CUDA: when the pipeline module's ``core``
    answers for the CPU (its place list, the only CUDA-only step, gets the CPU place; the
    constructor, which picks the device, is not answered)."""
    return getattr(_in_minimize, "depth", 0) > 0 and not device.cuda_build()


def _cpu_place(_index):
    import paddle

    return paddle.CPUPlace()


def _compiled_with_cuda():
    return True


# What the pipeline module's ``core`` answers while minimize runs on a build without CUDA.
CPU_PLACE_ANSWERS = {"is_compiled_with_cuda": _compiled_with_cuda, "CUDAPlace": _cpu_place}


def _make_minimize(original):
    @functools.wraps(original)
    def minimize(self, loss, startup_program=None, parameter_list=None, no_grad_set=None):
        _in_minimize.depth = getattr(_in_minimize, "depth", 0) + 1
        try:
            result = original(self, loss, startup_program, parameter_list, no_grad_set)
        finally:
            _in_minimize.depth -= 1
        opt = loss.block.program._pipeline_opt
        opt["ph_micro_batch_size"] = self.micro_batch_size  # the runner sizes fetch buffers with it
        return result

    return minimize


# -- install --------------------------------------------------------------------------------

def apply(config, patcher) -> None:
    """Phases: check every target, then the send timeout, the device answer and the patches."""
    import paddle.incubate.optimizer.pipeline as pipeline_module
    from paddle.base import executor
    from paddle.distributed.fleet.meta_optimizers import common
    from paddle.distributed.fleet.meta_optimizers import pipeline_optimizer as fleet_pipeline

    from ...gloo import rings

    patcher.check_params(executor.Executor.run,
                         ["self", "program", "feed", "fetch_list", "feed_var_name", "fetch_var_name", "scope",
                          "return_numpy", "use_program_cache", "use_prune"], "Executor.run")
    patcher.check_params(pipeline_module.PipelineOptimizer.minimize,
                         ["self", "loss", "startup_program", "parameter_list", "no_grad_set"],
                         "PipelineOptimizer.minimize")
    patcher.check_params(common.CollectiveHelper._init_communicator,
                         ["self", "program", "current_endpoint", "endpoints", "rank", "ring_id", "wait_port",
                          "global_ring_id", "sync"], "CollectiveHelper._init_communicator")
    from . import lowering

    patcher.check_params(fleet_pipeline.PipelineOptimizer._init_process_group,
                         ["self", "pipeline_pair", "pipeline_ring_map"], "fleet PipelineOptimizer._init_process_group")
    timeout = config.seconds("static_pipeline_timeout")
    patcher.on_revert(rings.close_all, "static_pipeline rings")
    patcher.on_revert(lowering.shutdown, "static_pipeline sender threads")
    deadline = (timeout, config.deadline_setting("static_pipeline_timeout"))
    patcher.set(executor.Executor, "run", _make_run(executor.Executor.run, deadline))
    patcher.answer(pipeline_module, "core", CPU_PLACE_ANSWERS, when=_minimizing_without_cuda, why="PipelineOptimizer.minimize's place list")
    patcher.set(pipeline_module.PipelineOptimizer, "minimize", _make_minimize(pipeline_module.PipelineOptimizer.minimize))
    patcher.set(fleet_pipeline.PipelineOptimizer, "_init_process_group",
                rings.make_init_process_group(fleet_pipeline.PipelineOptimizer._init_process_group))
    patcher.set(common.CollectiveHelper, "_init_communicator",
                rings.make_init_communicator(common.CollectiveHelper._init_communicator, lambda: timeout))


COMPONENT = Component("static_pipeline", ("3.2.", "3.3."), "static_pipeline", apply)
