"""Group-sharded stage 3 with an optimizer built from parameter groups updates its sliced
parameters on step 1 only.

Before every ``step()``, ``GroupShardedStage3._update_params_slice`` gives each sliced parameter
a fresh slice parameter (``param.fw_storage = _TensorWrapper(param)``
which takes over the previous slice's memory and clears it) and points the optimizer at the
slices.  For a parameter list it rebuilds the list from the layer's parameters every step; for
parameter groups it maps each entry of ``param_group["params"]`` to ``entry.fw_storage`` and
keeps the entry when it has none.  From step 2 on the entries *are* the previous step's slices,
which have no ``fw_storage``: the groups keep the cleared slices of step 1, the new slices
(which hold this step's gradients) are never updated, and every sliced parameter stays at its
step-1 value (no error; seen: 0.03 off stage 2 after 4 AdamW steps).  Parameters too small to
be sliced are not affected.  Pure Python bookkeeping: on every device (seen on CPU/gloo).

Patch: ``_update_params_slice`` remembers which layer parameter each slice it put into the
groups belongs to, and before Paddle's own mapping the next step puts those parameters back, so
Paddle maps them to this step's slices as it does on step 1.  (The slices cannot be recognised
by name: Paddle's ``slice@<name>`` does not survive ``_share_buffer_to``.)
"""
from __future__ import annotations

import functools

__all__ = ["apply", "OWNERS_ATTR"]

OWNERS_ATTR = "_ph_slice_owners"
"""Stage 3 attribute: ``{id(slice parameter): layer parameter}`` of the slices the optimizer's
groups hold since the last step (the slices are kept alive by the groups, so ids are stable)."""


def _groups(stage3):
    groups = stage3._optim._param_groups
    return groups if groups and isinstance(groups[0], dict) else None  # None: a parameter list,
    # which Paddle rebuilds from the layer every step


def restore_group_params(stage3) -> int:
    """Put the layer's parameter back wherever the optimizer's groups hold a slice made for it
    at the last step; returns how many entries were replaced."""
    owners = getattr(stage3, OWNERS_ATTR, {})
    replaced = 0
    for group in _groups(stage3) or ():
        params = [owners.get(id(p), p) for p in group["params"]]
        replaced += sum(a is not b for a, b in zip(params, group["params"]))
        group["params"] = params
    return replaced


def _record_owners(stage3, before) -> None:
    """After Paddle mapped each group entry to its slice, in order: remember which layer
    parameter every new slice belongs to."""
    owners = {}
    for group, params in zip(_groups(stage3) or (), before):
        for param, entry in zip(params, group["params"]):
            if entry is not param:
                owners[id(entry)] = param
    setattr(stage3, OWNERS_ATTR, owners)


def _make_update_params_slice(orig):
    @functools.wraps(orig)
    def _update_params_slice(self):
        restore_group_params(self)  # phase 1: the groups name the layer's parameters again
        before = [list(g["params"]) for g in _groups(self) or ()]
        out = orig(self)            # phase 2: Paddle maps them to this step's slices
        _record_owners(self, before)  # phase 3: so that the next step can undo phase 2
        return out

    return _update_params_slice


def apply(config, patcher) -> None:
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_stage3 as gs3

    stage3 = patcher.require(gs3, "GroupShardedStage3", "group_sharded_stage3")
    patcher.check_params(stage3._update_params_slice, ["self"], "GroupShardedStage3._update_params_slice")
    patcher.set(stage3, "_update_params_slice", _make_update_params_slice(stage3._update_params_slice))
