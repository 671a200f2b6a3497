"""A layout of a job: its degrees, micro-batch size and recompute, spelled as ``verify`` spells layouts
plus ``mbN`` and ``rc{none,sel,full}`` (``tp4pp8vp2dp4mb1rcsel``; ``spN``: tensor parallel N with sequence
parallelism; ``sharding4s2``: sharding 4 at stage 2); and every layout of a job a model divides.
"""
from __future__ import annotations

import dataclasses
import re

__all__ = ["Layout", "parse", "enumerate_layouts", "RECOMPUTE"]

RECOMPUTE = ("none", "sel", "full")
_TOKEN = re.compile(r"(tp|sp|pp|vp|dp|sharding|mb|rc)(none|sel|full|\d+)(?:s(\d))?")


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vp: int = 1
    dp: int = 1
    sharding: int = 1
    stage: int = 1              # sharding stage (1: optimizer state, 2: + gradients, 3: + parameters)
    sp: bool = False
    mbs: int | None = None      # None: the fastest that fits
    recompute: str | None = None  # None: the fastest that fits

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.sharding

    @property
    def replicas(self) -> int:
        return self.dp * self.sharding

    def name(self) -> str:
        text = (f"sp{self.tp}" if self.sp else f"tp{self.tp}") + f"pp{self.pp}"
        text += f"vp{self.vp}" if self.vp > 1 else ""
        text += f"dp{self.dp}" if self.dp > 1 else ""
        text += f"sharding{self.sharding}" + (f"s{self.stage}" if self.stage > 1 else "") if self.sharding > 1 else ""
        text += f"mb{self.mbs}" if self.mbs else ""
        text += f"rc{self.recompute}" if self.recompute else ""
        return text

    __str__ = name


def parse(text: str) -> Layout:
    """A layout from its spelling; ValueError naming what is wrong."""
    fields, pos = {}, 0
    for match in _TOKEN.finditer(text):
        if match.start() != pos:
            break
        key, value, stage = match.groups()
        if key in fields or (key in ("tp", "sp") and "tp" in fields):
            raise ValueError(f"layout {text!r}: {key} given twice")
        if key == "rc":
            if value not in RECOMPUTE:
                raise ValueError(f"layout {text!r}: rc{value}: recompute is rcnone, rcsel or rcfull")
            fields["recompute"] = value
        elif value in RECOMPUTE:
            raise ValueError(f"layout {text!r}: {key}{value}: {key} takes a number")
        elif key in ("tp", "sp"):
            fields["tp"], fields["sp"] = int(value), key == "sp"
        elif key == "mb":
            fields["mbs"] = int(value)
        else:
            fields[key] = int(value)
            if stage:
                if key != "sharding":
                    raise ValueError(f"layout {text!r}: only sharding takes a stage (sharding4s2)")
                fields["stage"] = int(stage)
        pos = match.end()
    if pos != len(text) or not text:
        raise ValueError(f"layout {text!r}: cannot read {text[pos:]!r}; spell it as tp4pp8vp2dp4mb1rcsel "
                         "(sp4 for tensor parallel 4 with sequence parallelism, sharding4s2 for a sharding stage)")
    layout = Layout(**fields)
    if min(layout.tp, layout.pp, layout.vp, layout.dp, layout.sharding, layout.mbs or 1) < 1:
        raise ValueError(f"layout {text!r}: every degree must be at least 1")
    if layout.vp > 1 and layout.pp < 2:
        raise ValueError(f"layout {text!r}: vp needs pp of 2 or more")
    if layout.stage not in (1, 2, 3):
        raise ValueError(f"layout {text!r}: sharding stage {layout.stage}: 1, 2 or 3")
    return layout


# The replicas as plain data parallel, or as sharding at stage 1 (optimizer state) or 2 (and gradients); stage 3,
# which gathers every layer's parameters in forward and backward, is priced only when asked (--layouts).
_DATA = ("dp", "sharding1", "sharding2")


def _data_degrees(data: str, replicas: int) -> dict:
    if data == "dp":
        return {"dp": replicas, "sharding": 1}
    return {"dp": 1, "sharding": replicas, "stage": int(data[-1])}


def _divisors(n: int):
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model, gpus: int, global_batch: int, gpus_per_node: int, max_mbs: int = 8):
    """Every layout of ``gpus`` the model divides: tp (a power of two within a node, dividing heads, kv heads,
    FFN and vocabulary) with and without sequence parallelism, pp dividing the layers, vp where the chunks
    divide them, data parallel as plain dp or sharding stage 1 or 2 over the replicas, micro-batch sizes
    dividing the per-replica batch, each recompute."""
    out = []
    for tp in [t for t in (1, 2, 4, 8, 16) if t <= gpus_per_node and gpus % t == 0]:
        if model.heads % tp or model.kv_heads % tp or model.ffn % tp or model.vocab % tp:
            continue
        for pp in _divisors(gpus // tp):
            if model.layers % pp or pp > model.layers:
                continue
            replicas = gpus // (tp * pp)
            if global_batch % replicas:
                continue
            per_replica = global_batch // replicas
            for vp in [v for v in (1, 2, 3, 4, 6, 8) if pp > 1 or v == 1]:
                if model.layers % (pp * vp):
                    continue
                for mbs in [m for m in _divisors(per_replica) if m <= max_mbs]:
                    micro = per_replica // mbs
                    if vp > 1 and micro % pp:
                        continue  # fleet's interleaved schedule needs microbatches a multiple of pp
                    for sp in ((False, True) if tp > 1 else (False,)):
                        for data in _DATA if replicas > 1 else _DATA[:1]:
                            for rc in RECOMPUTE:
                                out.append(Layout(tp=tp, pp=pp, vp=vp, sp=sp, mbs=mbs, recompute=rc,
                                                  **_data_degrees(data, replicas)))
    return out
