"""See the pipeline: a per-rank timeline of every forward, backward, p2p exchange, gradient
sync and optimizer update, gathered on rank 0 into a Chrome trace and a Gantt chart, with the
measured bubble next to the schedule's theoretical one.

    import paddle_hybrid
    paddle_hybrid.dygraph.timeline.enable()            # or PADDLE_HYBRID_TIMELINE=1 before the import
    ... model.train_batch(...) for every step ...
    paddle_hybrid.dygraph.timeline.finish("runs/timeline", num_stages=pp, num_micro=acc, num_chunks=vp)

:func:`finish` is collective (every rank calls it): rank 0 writes ``<tag>.trace.json`` (opens in
Perfetto or chrome://tracing) and ``<tag>.png``, prints the bubble summary and returns it.

Modules: :mod:`.recorder` (hooks and clocks), :mod:`.trace` (Chrome trace), :mod:`.gantt`
(PNG), :mod:`.bubble` (measured and theoretical bubble, order checks); ideal timelines for
tests are :mod:`paddle_hybrid.testing.ideal_timeline`.
"""
from __future__ import annotations

import os
import socket

from ...registry.component import Component
from .recorder import RECORDER, install_hooks

__all__ = ["enable", "disable", "is_enabled", "events", "finish", "apply", "RECORDER", "COMPONENT"]


def enable(config=None) -> None:
    """Start recording every following ``train_batch`` of a fleet pipeline model.

    The hooks are the timeline component (installed again with ``timeline=True`` on ``config``, by
    default the config the plugin was installed with), so ``paddle_hybrid.patches()`` lists them
    and ``paddle_hybrid.uninstall()`` removes them."""
    import dataclasses

    if is_enabled():
        return
    config = config if config is not None else COMPONENT.config
    if config is None:
        raise RuntimeError("paddle_hybrid.timeline.enable: the plugin is not installed; call "
                           "paddle_hybrid.install() first, or pass enable(config=PluginConfig(...)).")
    ok, message = COMPONENT.is_verified(config)
    if not ok:
        raise RuntimeError(message.replace("skipped", "not recording"))
    state = COMPONENT.install(dataclasses.replace(config, timeline=True))
    if state.status != "active":
        raise RuntimeError(f"paddle_hybrid.timeline: not recording: {state.reason}")


def disable() -> None:
    """Stop recording (the events recorded so far stay in :data:`RECORDER`): the component is
    installed again with ``timeline=False``, so it keeps the config :func:`finish` reads."""
    import dataclasses

    if COMPONENT.config is None:
        return
    COMPONENT.install(dataclasses.replace(COMPONENT.config, timeline=False))


def is_enabled() -> bool:
    return COMPONENT.is_active()


def events() -> list:
    """This rank's recorded events."""
    return list(RECORDER.events)


# -- the plugin component: PluginConfig.timeline turns recording on at import --------------

def apply(config, patcher) -> None:
    install_hooks(patcher)


COMPONENT = Component("timeline", ("3.2.", "3.3."), "timeline", apply,
                      off_reason="off (PADDLE_HYBRID_TIMELINE=1 or timeline.enable() records)")


# -- gathering ---------------------------------------------------------------------------

def _gather(local_events, timeout: float):
    """Every rank's events, on every rank, on one time base: ranks on another host than rank 0
    are shifted by the difference of their clocks read right after a barrier (on one host the
    clock is shared and nothing is shifted).  Exchanged as JSON through the job's store
    (:mod:`paddle_hybrid.common.exchange`), within ``timeout`` seconds."""
    import time

    import paddle.distributed as dist

    from ...common.exchange import exchange

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(local_events)
    dist.barrier()
    mine = {"host": socket.gethostname(), "clock": time.perf_counter(), "events": local_events}
    ranks = list(range(dist.get_world_size()))
    by_rank = exchange(mine, topic="timeline events", ranks=ranks, rank=dist.get_rank(), timeout=timeout,
                       setting="PADDLE_HYBRID_TIMEOUT")
    everyone = [by_rank[r] for r in ranks]
    host0, clock0 = everyone[0]["host"], everyone[0]["clock"]
    merged = []
    for part in everyone:
        shift = 0.0 if part["host"] == host0 else part["clock"] - clock0
        merged.extend({**e, "start": e["start"] - shift, "end": e["end"] - shift} for e in part["events"])
    return merged


def finish(out_dir: str, num_stages: int, num_micro: int, num_chunks: int = 1, tag: str = "timeline",
           verbose: bool = True, timeout: float | None = None):
    """Gather every rank's events to rank 0 and write the trace and the chart there.

    Collective: every rank must call it, and each waits at most ``timeout`` seconds for the others
    (None: ``PluginConfig.timeout`` of the config the timeline was last installed with, else
    :data:`~paddle_hybrid.config.DEFAULT_TIMEOUT`).  Returns, on rank 0, ``{"trace": path, "png": path or
    None, "summary": {...}, "events": [...]}``; None on the other ranks.
    """
    import paddle.distributed as dist

    from . import bubble, gantt, trace

    from ...config import DEFAULT_TIMEOUT

    if timeout is None:
        timeout = COMPONENT.config.timeout if COMPONENT.config is not None else DEFAULT_TIMEOUT
    merged = _gather(RECORDER.events, timeout)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    if not merged:
        raise RuntimeError("paddle_hybrid.dygraph.timeline.finish: no events were recorded; call "
                           "paddle_hybrid.dygraph.timeline.enable() before the first train_batch of a pipeline model.")
    os.makedirs(out_dir, exist_ok=True)
    trace_path = trace.write_chrome_trace(os.path.join(out_dir, f"{tag}.trace.json"), merged)
    png_path = os.path.join(out_dir, f"{tag}.png")
    title = f"{tag}: {num_stages} stages, {num_micro} microbatches" + (f", {num_chunks} chunks" if num_chunks > 1 else "")
    plotted = gantt.plot_gantt(merged, png_path, title=title)
    summary = bubble.summary(merged, num_stages, num_micro, num_chunks)
    if verbose:
        print(bubble.format_summary(summary), flush=True)
        print(f"timeline: {trace_path}" + (f" | {png_path}" if plotted else " | (no matplotlib: no PNG)"), flush=True)
    return {"trace": trace_path, "png": png_path if plotted else None, "summary": summary, "events": merged}
