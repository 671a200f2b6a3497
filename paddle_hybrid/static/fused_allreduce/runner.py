"""Executing a data-parallel static program rewritten by the plugin.

Two paths, chosen by :func:`use_pir_path` (a run on a GPU place takes the ordinary one; a
CUDA build running on CPU takes the PIR one):

* **CPU (gloo), verified.**  The legacy executor has no CPU kernels for
  collectives.  The runner translates the legacy program to PIR once
  (:func:`.pir_repair.translate_with_repair`, which repairs the
  translation of the plugin's custom ops), makes sure the gloo process group
  of ring 0 exists (``paddle.distributed.init_parallel_env`` in dygraph), and
  runs the PIR program with ``paddle.static.Executor``.  Parameters live in
  the executor's scope, shared by the startup and main programs.
* **GPU (NCCL), written, not executed here.**  ``exe.run`` on the legacy
  program, as with Paddle's own ``RawProgramOptimizer``; the communicator is
  created by ``c_comm_init`` ops the meta optimizer put in the startup program.

Before the first step the runner checks that every rank built the same
gradient layout (:func:`check_layout_across_ranks`, through
:func:`paddle_hybrid.common.layout_check.gather_and_compare`): through the job's store, so a
check that runs out of time names the missing ranks and leaves no collective of the default
group behind.
"""
from __future__ import annotations

import numpy as np
import paddle
from paddle.base import framework

from ...common.layout_check import DEFAULT_TIMEOUT, LayoutMismatchError, gather_and_compare
from ...gloo.groups import ensure_process_group
from .pir_repair import translate_with_repair
from .plan import FusedLayout, describe_entry, layout_fingerprint

__all__ = ["StaticRunner", "use_pir_path", "ensure_process_group", "check_layout_across_ranks"]

DP_GROUP = None
"""The process group of the data-parallel collectives (ring 0): the default group."""


def use_pir_path(place=None) -> bool:
    """True where collectives must run through PIR (every non-GPU place): decided by where the
    run is (``place``, or the current device), not by how Paddle was compiled."""
    from ...registry.device import cuda_build, running_on_cpu

    if not cuda_build():
        return True
    if place is None:
        return running_on_cpu()
    return not isinstance(place, paddle.CUDAPlace)


def check_layout_across_ranks(layout: FusedLayout, timeout: float = DEFAULT_TIMEOUT,
                              setting: str = "PADDLE_HYBRID_TIMEOUT") -> str:
    """Compare ``layout`` with every rank's; return its fingerprint.

    Raises :class:`~paddle_hybrid.common.layout_check.LayoutMismatchError` naming the first differing
    gradient and the two ranks, or :class:`~paddle_hybrid.common.exchange.ExchangeTimeout` (a
    ``TimeoutError``) after ``timeout`` seconds naming the ranks that did not arrive and
    ``setting``; never hangs, and leaves no collective behind.
    """
    import paddle.distributed as dist

    fingerprint = layout_fingerprint(layout)
    if dist.get_world_size() <= 1:
        return fingerprint
    ensure_process_group()
    gather_and_compare(
        layout.entries(), group=DP_GROUP, timeout=timeout, setting=setting, what="gradient layout of the fused all_reduce",
        describe=describe_entry, error=LayoutMismatchError,
        fix="Every rank must build the same model with the same parameter names and the same strategy "
            "(fuse_grad_size_in_MB / fuse_grad_size_in_num).")
    return fingerprint


class StaticRunner:
    """Runs a program rewritten by the plugin's fused all-reduce meta optimizer.

    ``main_program`` must carry the layout (``_ph_fused_allreduce``) that
    :func:`.rewrite.apply_fuse_allreduce` stores.  ``check_timeout`` (seconds) bounds the
    cross-rank layout check done at construction; None: the deadline the plugin's meta optimizer
    stored with the program (``PluginConfig.seconds("static_layout_check_timeout")`` of the config
    it was installed with), else :data:`paddle_hybrid.config.DEFAULT_TIMEOUT`.
    """

    def __init__(self, main_program, startup_program=None, place=None, check_timeout: float | None = None):
        if not isinstance(main_program, framework.Program):
            raise TypeError(
                f"StaticRunner: expected a legacy static Program, got {type(main_program).__name__}."
            )
        self.layout = getattr(main_program, "_ph_fused_allreduce", None)
        if self.layout is None:
            raise ValueError(
                "StaticRunner: this program was not rewritten by paddle_hybrid's fused all_reduce "
                "(run fleet.distributed_optimizer(opt, strategy).minimize(loss) with "
                "strategy.fuse_all_reduce_ops set, on more than one rank)."
            )
        self.main_program = main_program
        self.startup_program = startup_program
        self.place = place if place is not None else paddle.CPUPlace()
        self.pir = use_pir_path(self.place)
        self.exe = paddle.static.Executor(self.place)
        self.scope = paddle.static.global_scope()
        if self.pir:
            ensure_process_group()
        if check_timeout is not None:
            deadline = (check_timeout, "check_timeout (StaticRunner)")
        else:  # what the plugin's meta optimizer stored with the program, from the plugin's config
            deadline = getattr(main_program, "_ph_layout_check_deadline", (DEFAULT_TIMEOUT, "PADDLE_HYBRID_TIMEOUT"))
        self.fingerprint = check_layout_across_ranks(self.layout, *deadline)
        self._compiled: dict = {}

    def _translated(self, program):
        key = id(program)
        if key not in self._compiled:
            self._compiled[key] = (program, *translate_with_repair(program))
        return self._compiled[key][1:]

    def run_startup(self) -> None:
        """Initialise the parameters (and broadcast them from rank 0)."""
        if self.startup_program is None:
            raise ValueError("StaticRunner.run_startup: no startup_program was given.")
        self._run(self.startup_program, None, [])

    def run(self, feed=None, fetch_list=None):
        """One step of the main program; ``fetch_list`` holds names or Variables."""
        return self._run(self.main_program, feed, fetch_list or [])

    def _run(self, program, feed, fetch_list):
        names = [f.name if isinstance(f, framework.Variable) else str(f) for f in fetch_list]
        if not self.pir:
            return self.exe.run(program, feed=feed, fetch_list=names, scope=self.scope)
        pir_program, mapping = self._translated(program)
        fetch = []
        for n in names:
            if n not in mapping:
                raise KeyError(f"StaticRunner: {n!r} is not a variable of the program; fetch one that is.")
            fetch.append(mapping[n][-1])
        with paddle.pir_utils.IrGuard():
            out = self.exe.run(pir_program, feed=feed, fetch_list=fetch, scope=self.scope)
        return [np.asarray(o) for o in out]

    def param(self, name: str) -> np.ndarray:
        """Current value of a persistable variable in the runner's scope."""
        var = self.scope.find_var(name)
        if var is None:
            raise KeyError(f"StaticRunner.param: {name!r} is not in the scope; run the startup program first.")
        return np.array(var.get_tensor())
