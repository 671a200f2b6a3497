"""The dry run's ``--png``: each rank class's GPU estimate of memory as stacked bars (parameters, gradients,
optimizer state, activations of the microbatches in flight) against the GPU's size; with ``--gpu``, also the
job's estimated step per stage as a timeline (:func:`paddle_hybrid.plan.pictures.step_timeline`)."""
from __future__ import annotations

__all__ = ["memory_bars"]

GiB = 2 ** 30
PARTS = (("parameters", "#56B4E9"), ("gradients", "#009E73"), ("optimizer", "#E69F00"),
         ("activations in flight", "#CC79A7"))


def _parts(entry):
    g = entry["gpu_estimate"]
    return (g["parameters_bytes"], g["gradients_bytes"], g["optimizer_bytes"],
            g["activations_bytes_per_microbatch"] * entry["in_flight_microbatches"])


def memory_bars(entries, path: str, title=None) -> bool:
    """Write the bars of every class entry to ``path``; False without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(max(6, 1.2 * len(entries) + 3), 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bottoms = [0.0] * len(entries)
    for i, (label, color) in enumerate(PARTS):
        heights = [_parts(e)[i] / GiB for e in entries]
        ax.bar(range(len(entries)), heights, bottom=bottoms, color=color, edgecolor="black", linewidth=0.3,
               label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    device = entries[0]["gpu_estimate"]["device_bytes"] / GiB if entries else 0
    ax.axhline(device, color="black", linestyle="--", linewidth=0.8, label=f"GPU memory ({device:.0f} GiB)")
    ax.set_xticks(range(len(entries)))
    ax.set_xticklabels([e["class"] for e in entries], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GiB a GPU (estimated: bf16, flash attention)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(title or "memory of each rank class on the GPU (an estimate)")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    return True
