"""``--compose-layers``: a model too large to run whole here, measured with 1 and with 2 layers a pipeline chunk
and composed to its own layers.

A chunk's layers are alike, so every figure a rank class measures is a part that does not depend on the layers
(embedding, head, loss, the pipeline's messages) plus one layer's part times the layers: with ``a`` measured at
1 layer a chunk and ``b`` at 2, the figure at ``k`` layers a chunk is ``a + (k - 1) (b - a)``.  Composed so:
parameters, gradients and optimizer state (by dtype), activations saved per microbatch (by kind), the
step-2 peak, each collective's calls and bytes by operation and group, and each recorded kernel's calls (by
op, shapes, phase; the optimizer's own kernels left out), fused FSDP's gathered group (``fused_fsdp``'s
``gathered_*``: linear when every layer is in one group, constant when each layer is a group); the composed
peak and the GPU estimate are computed again from the composed parts.  Not composed: the wall time and memory
of the dry run's own processes (those of the 2-layer run), the sharding partition.  Checked equal to the full dry run of
``examples/gpt_pp.py`` (tests/dryrun/test_compose_layers.py).
"""
from __future__ import annotations

from . import gpu_estimate

__all__ = ["entries", "compose_entry", "per_chunk_layers", "NOTE"]

NOTE = ("composed (--compose-layers): every class measured with {one} and with {two} layers (1 and 2 a pipeline "
        "chunk) and each figure composed to the script's {layers} ({per_chunk} a chunk): parameters, gradients, "
        "optimizer state, activations, the step-2 peak, collectives' calls and bytes; the dry run's own wall time "
        "and memory are the 2-layer run's")
_LINEAR = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes",
           "activations_bytes_per_microbatch", "peak_bytes")
_LINEAR_DICTS = ("parameters_by_dtype", "gradients_by_dtype", "optimizer_by_dtype",
                 "activations_by_kind_per_microbatch")


def per_chunk_layers(total: int, chunks: int) -> int:
    """Layers a chunk of the script's model; SystemExit where composing cannot hold."""
    if total % chunks:
        raise SystemExit(f"--compose-layers: {total} layers do not divide over {chunks} pipeline chunks")
    per_chunk = total // chunks
    if per_chunk < 3:
        raise SystemExit(f"--compose-layers: {per_chunk} layers a chunk are measured as they are: run without it")
    return per_chunk


def _line(a, b, k):
    return a + (k - 1) * (b - a)


def _dict(a: dict, b: dict, k) -> dict:
    return {key: _line((a or {}).get(key, 0), (b or {}).get(key, 0), k) for key in sorted(set(a or {}) | set(b or {}))}


def _communication(a: list, b: list, k) -> list:
    """Calls and bytes by (operation, group), composed; the order of the 2-layer run."""
    first = {(c["op"], tuple(c["group"] or ())): c for c in a}
    out = []
    for c in b:
        base = first.get((c["op"], tuple(c["group"] or ())), {"calls": 0, "bytes": 0})
        out.append(dict(c, calls=_line(base["calls"], c["calls"], k), bytes=_line(base["bytes"], c["bytes"], k)))
    missing = [key for key in first if key not in {(c["op"], tuple(c["group"] or ())) for c in b}]
    if missing:
        raise ValueError(f"--compose-layers: the 1-layer run made collectives the 2-layer run did not: {missing}")
    return out


def _kernel_key(rec) -> str:
    return repr({key: value for key, value in rec.items() if key != "calls"})


def _kernels(a: list, b: list, k) -> list:
    """Each recorded kernel's calls composed (a kernel of another shape in one run only: its calls as a line
    through 0).  The optimizer's own kernels (phase ``update``) are left out: their shapes follow the parameters'
    count, not a layer's, and the estimate prices the optimizer from the parameters."""
    a = [r for r in a if r["phase"] != "update"]
    b = [r for r in b if r["phase"] != "update"]
    first = {_kernel_key(r): r["calls"] for r in a}
    out = [dict(r, calls=_line(first.pop(_kernel_key(r), 0), r["calls"], k)) for r in b]
    out += [dict(r, calls=_line(r["calls"], 0, k)) for r in a if _kernel_key(r) in first]
    return [r for r in out if r["calls"] > 0]


def compose_entry(a: dict, b: dict, k: int) -> dict:
    """Class entry ``b`` (2 layers a chunk) with every layer-dependent figure composed to ``k`` layers a chunk from it
    and ``a`` (1 layer a chunk)."""
    if a["class"] != b["class"]:
        raise ValueError(f"--compose-layers: the runs found other classes ({a['class']} against {b['class']})")
    out = dict(b)
    for key in _LINEAR:
        out[key] = _line(a[key], b[key], k)
    for key in _LINEAR_DICTS:
        if key in b:
            out[key] = _dict(a.get(key), b.get(key), k)
    out["communication"] = _communication(a["communication"], b["communication"], k)
    out["kernels"] = _kernels(a.get("kernels", []), b.get("kernels", []), k)
    gathered = 0
    if b.get("fused_fsdp") and a.get("fused_fsdp"):  # fused FSDP's whole group: one group of every layer, or a layer's
        fsdp = dict(b["fused_fsdp"], composed_from="1 and 2 layers a chunk (buffers: the 2-layer run's)")
        for key in ("gathered_parameters_bytes", "gathered_gradients_bytes"):
            fsdp[key] = _line(a["fused_fsdp"][key], b["fused_fsdp"][key], k)
        out["fused_fsdp"] = fsdp
        gathered = fsdp["gathered_parameters_bytes"] + fsdp["gathered_gradients_bytes"]
    out["composed_peak_bytes"] = int(out["parameters_bytes"] + out["gradients_bytes"] + out["optimizer_bytes"]
                                     + out["activations_bytes_per_microbatch"] * out["in_flight_microbatches"]
                                     + gathered)
    out["gpu_estimate"] = gpu_estimate.estimate(out, b["gpu_estimate"]["device_bytes"])
    out["composed_from"] = "1 and 2 layers a chunk"
    return out


def entries(one: list, two: list, k: int) -> list:
    """Every class entry composed (see :func:`compose_entry`)."""
    if len(one) != len(two):
        raise ValueError(f"--compose-layers: {len(one)} classes with 1 layer a chunk, {len(two)} with 2")
    return [compose_entry(a, b, k) for a, b in zip(one, two)]
