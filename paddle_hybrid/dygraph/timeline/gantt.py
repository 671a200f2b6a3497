"""PNG Gantt chart of timeline events with matplotlib (optional dependency; no Paddle import).

Each rank is a row (rank 0 at the top) split in three bands so nothing hides
the compute bars: a thin ``sync`` band above (gradient sync, optimizer), the
compute band in the middle (forward / backward, labelled with the microbatch
when the bar is wide enough) and a thin ``comm`` band below.
"""
from __future__ import annotations

from ._events import CATEGORIES, check_events, compute_label

__all__ = ["COLORS", "plot_gantt"]

#: Bar colour of each category (colour-blind friendly Okabe-Ito hues).
COLORS = {
    "forward": "#56B4E9",    # sky blue
    "backward": "#E69F00",   # orange
    "comm": "#CC79A7",       # reddish purple
    "grad_sync": "#009E73",  # bluish green
    "optimizer": "#555555",  # dark grey
}

# (offset of the band's top from the row centre, band height), in row units;
# the y axis is inverted so positive offsets are lower on the page.
_BANDS = {
    "grad_sync": (-0.45, 0.12),
    "optimizer": (-0.45, 0.12),
    "forward": (-0.3, 0.5),
    "backward": (-0.3, 0.5),
    "comm": (0.23, 0.12),
}

_MS = 1e3


def _label(ev, width_ms, span_ms) -> str | None:
    """Microbatch label for a compute bar, or None if the bar is too narrow to hold it.

    Widths are compared with the whole span because the figure width is fixed:
    about 1.2% of the span per character is legible at 12 inches.
    """
    if ev["cat"] not in ("forward", "backward") or ev.get("micro") is None:
        return None
    text = compute_label(ev)[1:]  # colour already says F or B; keep "3" / "3.c1"
    return text if width_ms >= 0.012 * span_ms * max(len(text), 1) else None


def plot_gantt(events, path, title=None) -> bool:
    """Write a PNG Gantt chart of ``events`` to ``path``; True on success.

    Returns False without writing anything when matplotlib cannot be
    imported, so a training run never fails for want of a plotting library.
    Uses the Agg canvas directly (not pyplot) to leave the caller's backend
    and figure state alone.  ValueError for an empty event list.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        return False
    events = check_events(events)
    if not events:
        raise ValueError("no events to plot")
    t0 = min(e["start"] for e in events)
    span_ms = max(max(e["end"] for e in events) - t0, 1e-12) * _MS
    ranks = sorted({e["rank"] for e in events})
    row = {r: i for i, r in enumerate(ranks)}

    fig = Figure(figsize=(12, 1.2 + 0.7 * len(ranks)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    present = [c for c in CATEGORIES if any(e["cat"] == c for e in events)]
    for cat in present:
        for r in ranks:
            bars = [((e["start"] - t0) * _MS, (e["end"] - e["start"]) * _MS)
                    for e in events if e["rank"] == r and e["cat"] == cat]
            if not bars:
                continue
            top, height = _BANDS[cat]
            ax.broken_barh(bars, (row[r] + top, height), facecolors=COLORS[cat],
                           edgecolor="black", linewidth=0.3)
    for e in events:
        x, w = (e["start"] - t0) * _MS, (e["end"] - e["start"]) * _MS
        text = _label(e, w, span_ms)
        if text is not None:
            top, height = _BANDS[e["cat"]]
            ax.text(x + w / 2, row[e["rank"]] + top + height / 2, text,
                    ha="center", va="center", fontsize=7, clip_on=True)

    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # inverted: rank 0 at the top
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.legend(handles=[Patch(facecolor=COLORS[c], edgecolor="black", label=c) for c in present],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "pipeline timeline")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    return True
