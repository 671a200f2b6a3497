"""Pictures of the estimate (matplotlib, optional: without it nothing is drawn and the caller says so).

* :func:`layouts_scatter`: ``plan --png``: every priced layout by step time against memory per GPU, the GPU's
  memory as a line, the best starred and the layouts within the estimate's error of it (ties) ringed;
* :func:`step_timeline`: one layout's simulated step per pipeline stage (forward, backward, then the exposed
  data-parallel communication and the optimizer), through the timeline's Gantt chart.
"""
from __future__ import annotations

__all__ = ["layouts_scatter", "step_timeline"]

GiB = 2 ** 30


def _figure(width, height):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def layouts_scatter(estimates, path: str, memory_bytes: int, tie=None, title=None) -> bool:
    """Write the scatter of ``estimates`` (sorted best first, fitting first) to ``path``; False without matplotlib."""
    fig = _figure(10, 6)
    if fig is None:
        return False
    ax = fig.add_subplot(1, 1, 1)
    fits = [e for e in estimates if e.fits]
    over = [e for e in estimates if not e.fits]
    ax.scatter([e.peak_bytes_per_gpu / GiB for e in fits], [e.step_time_s for e in fits], s=14, c="#56B4E9",
               label="fits", zorder=2)
    ax.scatter([e.peak_bytes_per_gpu / GiB for e in over], [e.step_time_s for e in over], s=14, c="#999999",
               marker="x", label="does not fit", zorder=1)
    if fits:
        best = fits[0]
        ties = [e for e in fits[1:] if tie and e.step_time_s <= best.step_time_s * (1 + tie)]
        ax.scatter([e.peak_bytes_per_gpu / GiB for e in ties], [e.step_time_s for e in ties], s=60,
                   facecolors="none", edgecolors="#E69F00", label=f"tie (within {tie * 100:.1f} %)" if tie else "tie",
                   zorder=3)
        ax.scatter([best.peak_bytes_per_gpu / GiB], [best.step_time_s], s=160, marker="*", c="#D55E00",
                   label=f"best: {best.layout.name()}", zorder=4)
    ax.axvline(memory_bytes / GiB, color="black", linestyle="--", linewidth=0.8, label="GPU memory")
    right = 3 * memory_bytes / GiB  # layouts far past the GPU's memory would squeeze the ones that matter
    beyond = sum(e.peak_bytes_per_gpu / GiB > right for e in estimates)
    ax.set_xlim(0, right)
    if beyond:
        ax.text(0.99, 0.02, f"{beyond} layouts need more than {right:.0f} GiB (not shown)", transform=ax.transAxes,
                ha="right", fontsize=8)
    ax.set_xlabel("memory per GPU (GiB, estimated)")
    ax.set_ylabel("step time (s, estimated)")
    ax.set_yscale("log")
    ax.grid(linestyle=":", linewidth=0.5)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(title or "layouts: an estimate")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    return True


def step_events(estimate) -> list:
    """The timeline's events of one estimated step: each stage's simulated forwards and backwards, then its exposed
    data-parallel communication and its optimizer."""
    events = []
    for e in estimate.timeline.events:
        cat = "forward" if str(e.action.kind) == "F" else "backward"
        events.append({"rank": e.rank, "step": 0, "name": str(e.action.kind), "cat": cat, "start": e.start,
                       "end": e.end, "micro": e.action.micro, "chunk": e.action.chunk})
    for stage in estimate.per_stage:
        end = stage["pipeline_s"]
        for cat, seconds in (("grad_sync", stage["dp_comm_s"]), ("optimizer", stage["optimizer_s"])):
            if seconds > 0:
                events.append({"rank": stage["stage"], "step": 0, "name": cat, "cat": cat, "start": end,
                               "end": end + seconds, "micro": None, "chunk": None})
                end += seconds
    return events


def step_timeline(estimate, path: str, title=None) -> bool:
    from ..dygraph.timeline.gantt import plot_gantt

    return plot_gantt(step_events(estimate), path, title=title or
                      f"{estimate.layout.name()}: one step, estimated ({estimate.step_time_s:.3f} s)")
