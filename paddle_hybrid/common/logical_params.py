"""A fleet model's parameters as one process names and shapes them, their digests, and the groups
of ranks that must hold the same ones.

Shared by :mod:`paddle_hybrid.dygraph.replica_check` (are replicas equal?) and
:mod:`paddle_hybrid.dygraph.verify_record` (what does this layout hold, to compare with one
process).

* **Names.** The model inside fleet's wrappers (``PipelineParallel``, ``TensorParallel``, ...,
  each keeps it as ``_layers``); names from its ``state_dict()``, which PaddleFormers' pipeline
  models give under the one-process model's names (``llama.layers.0.mlp.up_proj.weight``), else
  from ``named_parameters()``.
* **Whole values.** A parameter fleet marks ``is_distributed`` is this rank's slice along
  ``split_axis`` (column-parallel weights 1, row-parallel and vocab-parallel 0); its whole value is
  the concatenation of the tensor-parallel group's slices.  A fused projection (PaddleFormers'
  ``qkv_proj``, ``gate_up_proj`` / ``up_gate_proj``) may instead hold on each rank its share of
  every part (``[q_r, k_r, v_r]``): for those a second candidate is made, each part's shares
  joined, then the parts (:func:`whole`).  Everything else is whole on each rank.
* **Digests.** BLAKE2b of the bytes, the dtype and the shape: replicas updated by the same
  arithmetic are bitwise equal, so any difference is a real one.
"""
from __future__ import annotations

import hashlib

__all__ = ["unwrap", "named_parameters", "aliases", "is_split", "whole", "join", "digest", "groups",
           "shared_weights", "NoSplitAxisError"]


class NoSplitAxisError(ValueError):
    """A parameter marked ``is_distributed`` without a ``split_axis``: its whole value is unknown."""


def unwrap(model):
    """The user's layer inside fleet's (and ``paddle.DataParallel``'s) wrappers."""
    import paddle

    while isinstance(getattr(model, "_layers", None), paddle.nn.Layer):
        model = model._layers
    return model


def named_parameters(model) -> list:
    """``[(name, parameter)]`` of ``model`` (wrappers removed), under the names one process would
    use where the model says them (``state_dict()``), each parameter once."""
    inner = unwrap(model)
    params = {id(p): p for p in inner.parameters()}
    named, seen = [], set()
    try:
        state = inner.state_dict()
    except Exception:  # noqa: BLE001  (a model whose state_dict needs more than this: the plain names)
        state = {}
    for name, value in list(state.items()) + list(inner.named_parameters()):
        if id(value) in params and id(value) not in seen:
            named.append((name, value))
            seen.add(id(value))
    return named


def aliases(model) -> dict:
    """``{other name: name}`` for a parameter the model holds under two names (a tied embedding
    and LM head in one process), ``name`` being the one :func:`named_parameters` gives."""
    inner = unwrap(model)
    primary = {id(p): name for name, p in named_parameters(model)}
    try:
        state = inner.state_dict()
    except Exception:  # noqa: BLE001
        state = {}
    out = {}
    for name, value in list(state.items()) + list(inner.named_parameters(include_sublayers=True)):
        first = primary.get(id(value))
        if first is not None and name != first:
            out[name] = first
    return out


def is_split(param) -> bool:
    """Is ``param`` this rank's slice of a tensor-parallel parameter?"""
    return bool(getattr(param, "is_distributed", False))


def _array(tensor):
    import numpy as np

    value = tensor.detach()
    if value.dtype not in (np.float32, np.float64) and "float" in str(value.dtype):
        value = value.astype("float32")  # bfloat16 / float16: compared as float32
    return value.numpy()


def fused_parts(name: str, config) -> list | None:
    """The sizes, relative to each other, of the parts fused into parameter ``name`` (a
    PaddleFormers naming convention), or None for a plain parameter."""
    leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if leaf in ("gate_up_proj", "up_gate_proj"):
        return [1, 1]
    if leaf == "qkv_proj" and config is not None:
        heads = int(getattr(config, "num_attention_heads", 0) or 0)
        kv = int(getattr(config, "num_key_value_heads", 0) or heads)
        return [heads, kv, kv] if heads else None
    return None


def whole(param, mp_group, name: str = "", config=None) -> dict:
    """The whole value of ``param``: ``{"": array}``, gathered over the tensor-parallel group
    ``mp_group`` when it is a slice (a collective: every rank of the group must call it for the
    same parameter), else this rank's own.  A parameter whose ``name`` says it may be a fused
    projection (:func:`fused_parts`, with the model's ``config``) gets a second candidate,
    ``{"by_part": array}``: each part's shares joined, then the parts.  Which of the two is the
    model's layout is the model's forward's business (ERNIE-4.5 interleaves q, k, v per key-value
    head group, so joining the slices is right; Phi3 puts all of q, then k, then v, so the parts
    must be joined); a comparison takes the candidate the other side agrees with."""
    import paddle.distributed as dist

    if not is_split(param) or mp_group is None or mp_group.nranks == 1:
        return {"": _array(param)}
    axis = getattr(param, "split_axis", None)
    if axis is None:
        raise NoSplitAxisError(f"parameter {param.name} is marked is_distributed but has no split_axis")
    gathered = []
    dist.all_gather(gathered, param.detach(), group=mp_group)
    return join([_array(p) for p in gathered], int(axis), fused_parts(name, config))


def join(slices: list, axis: int, parts: list | None = None) -> dict:
    """The whole value from the tensor-parallel ranks' ``slices`` (in rank order) along ``axis``:
    ``{"": array}``, and with ``parts`` (:func:`fused_parts`) the candidate ``"by_part"`` of
    :func:`whole`.  No collective: the verifier joins the slices each rank recorded."""
    import numpy as np

    out = {"": np.concatenate(slices, axis=axis)}
    if parts is not None and slices[0].shape[axis] % sum(parts) == 0:
        unit = slices[0].shape[axis] // sum(parts)
        bounds = np.cumsum([unit * r for r in parts])[:-1]
        per_part = zip(*[np.split(s, bounds, axis=axis) for s in slices])  # part k of every rank
        out["by_part"] = np.concatenate([np.concatenate(list(shares), axis=axis) for shares in per_part], axis=axis)
    return out


def digest(array) -> str:
    """A digest of a NumPy array's bytes, dtype and shape."""
    h = hashlib.blake2b(digest_size=16)
    h.update(str(array.dtype).encode())
    h.update(str(tuple(array.shape)).encode())
    h.update(array.tobytes())
    return h.hexdigest()


def groups() -> dict:
    """This rank's hybrid-parallel groups as ``{kind: (group, global ranks)}`` for the kinds of
    degree > 1 (``mp``, ``dp``, ``sharding``, ``pp``); empty without fleet's hybrid group."""
    from paddle.distributed import fleet

    try:
        hcg = fleet.get_hybrid_communicate_group()
    except Exception:  # noqa: BLE001  (fleet not initialised: one process)
        return {}
    if hcg is None:
        return {}
    out = {}
    for kind, getter in (("mp", "get_model_parallel_group"), ("dp", "get_data_parallel_group"),
                         ("sharding", "get_sharding_parallel_group"), ("pp", "get_pipe_parallel_group")):
        group = getattr(hcg, getter)()
        if group is not None and group.nranks > 1:
            out[kind] = (group, list(group.ranks))
    return out


def shared_weights(model) -> list:
    """``[(key, parameter, global ranks)]``: each weight a ``PipelineLayer`` ties across stages
    (``SharedLayerDesc``), held by this rank, with the ranks that hold it."""
    inner = unwrap(model)
    comm = getattr(inner, "shared_comm", None) or {}
    layers = getattr(inner, "shared_layers", None)
    out = []
    for key, entry in comm.items():
        layer = layers[key] if layers is not None and key in layers else entry.get("layer")
        attr = entry.get("weight_attr")
        if layer is None or attr is None:
            continue
        for name in ([attr] if isinstance(attr, str) else list(attr)):
            param = getattr(layer, name, None)
            if param is not None:
                out.append((f"{key}.{name}", param, list(entry["ranks"])))
    return out
