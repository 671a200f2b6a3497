"""Fused gradient all-reduce for static data-parallel programs (legacy IR): the rewrite.

What :func:`apply_fuse_allreduce` does to the global block of a program whose backward and
optimizer ops are already appended:

1. after the loss-gradient op, ``scale`` by ``1/nranks`` (where Paddle's data parallel scales,
   ``RawProgramOptimizer._insert_loss_grad_ops``);
2. gradients are grouped (:func:`.plan.plan_groups`: by dtype, in the order backward finishes
   them, bounded by bytes and by count);
3. per group, right after the last op that produces one of its gradients::

       ph_coalesce_tensor(copy_data=True, use_align=False)  grads -> fused
       all_reduce(fused, SUM)
       ph_uncoalesce_tensor(grads, fused) -> grads             # copy back

   The copy back makes every later reader of a gradient (optimizer ops, clipping) read a value
   computed *from the reduced fused buffer*: a data dependency, not an aliasing assumption.  That
   is what makes the rewrite exact under PIR, where a custom op cannot alias its outputs into the
   fused buffer (``paddle_hybrid.ops``), and it stays correct where it does alias (legacy
   execution on GPU): the op then sees the same address and skips the copy.

With ``fuse=False`` every gradient gets its own ``all_reduce`` right after its last producer (the
unfused baseline, same scaling).  :func:`broadcast_parameters` makes the startup program broadcast
every parameter from rank 0 that no broadcast covers yet.

:class:`FuseAllreducePass` is the same as a Paddle pass (``ph_fuse_allreduce``, registered by
:mod:`paddle_hybrid.static.registration`): ``new_pass("ph_fuse_allreduce", {"params_grads": ...,
"nranks": 2}).apply([main], [startup])``.  All edits go through
:func:`paddle_hybrid.common.program_edit.deferred_sync`.
"""
from __future__ import annotations

import dataclasses

from paddle.base import core, framework
from paddle.distributed.passes.pass_base import PassBase, PassType
from paddle.utils import unique_name

from ... import ops
from ...common.program_edit import OP_ROLE_KEY, OpRole, deferred_sync, op_role
from .plan import FuseAllreduceConfig, FusedLayout, GradSlot, Group, plan_groups

__all__ = ["apply_fuse_allreduce", "broadcast_parameters", "FuseAllreducePass", "PASS_NAME", "FUSED_PREFIX",
           "DP_RING_ID"]

PASS_NAME = "ph_fuse_allreduce"
FUSED_PREFIX = "ph_fused_grad"
DP_RING_ID = 0
"""Communicator ring of the data-parallel group: the default group (every rank), ring 0."""
_REDUCE_SUM = 0  # paddle.distributed.ReduceOp.SUM
_BACKWARD, _OPTIMIZE, _LOSS = int(OpRole.Backward), int(OpRole.Optimize), int(OpRole.Loss)
_BROADCAST_TYPES = ("broadcast", "c_broadcast")


def _existing_layout(block, grad_names: set, nranks: int):
    """The layout of an already rewritten block, or None (for idempotence)."""
    groups = []
    for op in block.ops:
        if op.type == ops.COALESCE_OP:
            fused = op.output(ops.COALESCE_FUSED)
            if fused and fused[0].startswith(FUSED_PREFIX):
                names = op.input(ops.COALESCE_IN)
                slots = tuple(
                    GradSlot(n, tuple(block.var(n).shape), ops.dtype_name(block.var(n).dtype)) for n in names
                )
                groups.append(Group(op.attr("dtype"), slots, fused[0]))
        elif op.type == "all_reduce" and op.input("x") and op.input("x")[0] in grad_names:
            n = op.input("x")[0]
            v = block.var(n)
            groups.append(Group(ops.dtype_name(v.dtype), (GradSlot(n, tuple(v.shape), ops.dtype_name(v.dtype)),), n))
    if not groups:
        return None
    fused = any(g.fused_name.startswith(FUSED_PREFIX) for g in groups)
    return FusedLayout(tuple(groups), fused, nranks)


def _collect_slots(block, params_grads) -> list:
    ops_list = block.ops
    first_bwd = next((i for i, op in enumerate(ops_list) if op_role(op) & _BACKWARD), None)
    if first_bwd is None:
        raise ValueError(
            "fuse_allreduce: the program has no backward ops; call the optimizer's minimize "
            "(or append_backward) before the rewrite."
        )
    first_opt = next(
        (i for i, op in enumerate(ops_list) if i >= first_bwd and op_role(op) & _OPTIMIZE), len(ops_list)
    )
    last_writer: dict = {}
    for i in range(first_bwd, first_opt):
        for name in ops_list[i].output_arg_names:
            last_writer[name] = i
    slots = []
    for param, grad in params_grads:
        if grad is None:
            continue
        name = grad.name if hasattr(grad, "name") else str(grad)
        var = block.var(name)
        if var.type != core.VarDesc.VarType.DENSE_TENSOR:
            raise TypeError(
                f"fuse_allreduce: gradient {name!r} is {var.type}, not a dense tensor (sparse "
                "gradients, e.g. from sparse embeddings, are not supported); use dense gradients."
            )
        if name not in last_writer:
            raise ValueError(
                f"fuse_allreduce: no backward op produces gradient {name!r} of parameter "
                f"{getattr(param, 'name', param)!r}; pass the params_grads that minimize returned."
            )
        shape = tuple(int(d) for d in var.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"fuse_allreduce: gradient {name!r} has a dynamic shape {list(shape)}; parameters must have static shapes.")
        slots.append(GradSlot(name, shape, ops.dtype_name(var.dtype), last_writer[name]))
    return slots


def _scale_loss_grad(block, nranks: int) -> None:
    for idx, op in reversed(list(enumerate(block.ops))):
        role = op_role(op)
        if role & _BACKWARD and role & _LOSS:
            name = op.output_arg_names[0]
            block._insert_op_without_sync(
                idx + 1,
                type="scale",
                inputs={"X": [name]},
                outputs={"Out": [name]},
                attrs={"scale": 1.0 / nranks, OP_ROLE_KEY: _BACKWARD},
            )
            return
    raise ValueError("fuse_allreduce: no loss-gradient op found (op_role Backward|Loss); was backward appended?")


def _insert_group(block, pos: int, group: Group) -> Group:
    """Insert the ops of one group at ``pos``; returns the group with its fused name."""
    role = {OP_ROLE_KEY: _BACKWARD}
    names = [s.name for s in group.slots]
    fused = block.create_var(
        name=unique_name.generate(FUSED_PREFIX),
        dtype=block.var(names[0]).dtype,
        shape=[group.numel],
        persistable=False,
        stop_gradient=True,
    )
    new_ops = [
        dict(
            type=ops.COALESCE_OP,
            inputs={ops.COALESCE_IN: names},
            outputs={ops.COALESCE_OUT: names, ops.COALESCE_FUSED: [fused.name]},
            attrs={**ops.coalesce_attrs(group.dtype, copy_data=True, use_align=False), **role},
        ),
        dict(
            type="all_reduce",
            inputs={"x": [fused.name]},
            outputs={"out": [fused.name]},
            attrs={"ring_id": DP_RING_ID, "reduce_type": _REDUCE_SUM, **role},
        ),
    ]
    new_ops.append(
        dict(
            type=ops.UNCOALESCE_OP,
            inputs={ops.UNCOALESCE_IN: names, ops.UNCOALESCE_FUSED: [fused.name]},
            outputs={ops.UNCOALESCE_OUT: names},
            attrs={"use_align": False, "align_size": -1, **role},
        )
    )
    for k, spec in enumerate(new_ops):
        block._insert_op_without_sync(pos + k, **spec)
    return dataclasses.replace(group, fused_name=fused.name)


def _insert_single(block, pos: int, group: Group) -> Group:
    name = group.slots[0].name
    block._insert_op_without_sync(
        pos,
        type="all_reduce",
        inputs={"x": [name]},
        outputs={"out": [name]},
        attrs={"ring_id": DP_RING_ID, "reduce_type": _REDUCE_SUM, OP_ROLE_KEY: _BACKWARD},
    )
    return dataclasses.replace(group, fused_name=name)


def apply_fuse_allreduce(program, params_grads, config: FuseAllreduceConfig) -> FusedLayout:
    """Rewrite ``program``'s global block for data parallelism (see module doc).

    ``params_grads`` is what the inner optimizer's ``minimize``/``backward``
    returned.  Returns the :class:`FusedLayout`, also stored as
    ``program._ph_fused_allreduce``.  Idempotent: applying it to a rewritten
    program changes nothing and returns the existing layout.
    """
    if not isinstance(program, framework.Program):
        raise TypeError(
            f"apply_fuse_allreduce: expected a legacy static Program, got {type(program).__name__}. "
            "Build the program under paddle.pir_utils.OldIrGuard() (or FLAGS_enable_pir_api=0)."
        )
    block = program.global_block()
    grad_names = {g.name for _, g in params_grads if g is not None}
    existing = _existing_layout(block, grad_names, config.nranks)
    if existing is not None:
        layout = getattr(program, "_ph_fused_allreduce", None) or existing
        program._ph_fused_allreduce = layout
        return layout
    with deferred_sync(block):
        if config.scale_loss_grad and config.nranks > 1:
            _scale_loss_grad(block, config.nranks)
        slots = _collect_slots(block, params_grads)
        if not slots:
            raise ValueError("fuse_allreduce: no gradients to reduce (every parameter is stop_gradient?).")
        groups = plan_groups(slots, config)
        placed = [None] * len(groups)
        # insert from the back so earlier positions stay valid; equal positions:
        # the later group is inserted first and so ends up after the earlier one
        for gi in range(len(groups) - 1, -1, -1):
            g = groups[gi]
            pos = g.insert_after + 1
            if config.fuse:
                placed[gi] = _insert_group(block, pos, g)
            else:
                placed[gi] = _insert_single(block, pos, g)
    layout = FusedLayout(tuple(placed), bool(config.fuse), config.nranks)
    program._ph_fused_allreduce = layout
    return layout


def broadcast_parameters(startup_program, ring_id: int = DP_RING_ID) -> list:
    """Append to ``startup_program`` a broadcast from rank 0 of every parameter that no
    ``broadcast``/``c_broadcast`` on ``ring_id`` covers yet (distributed parameters excepted:
    each rank holds its own slice).  Returns the names broadcast now; calling it twice adds
    nothing the second time."""
    block = startup_program.global_block()
    covered = {name for op in block.ops if op.type in _BROADCAST_TYPES
               and op.has_attr("ring_id") and op.attr("ring_id") == ring_id for name in op.input_arg_names}
    added = []
    for param in block.iter_parameters():
        if param.is_distributed or param.name in covered:
            continue
        block.append_op(type="broadcast", inputs={"x": param}, outputs={"out": param},
                        attrs={"ring_id": ring_id, "root": 0, OP_ROLE_KEY: int(OpRole.Forward)})
        added.append(param.name)
    return added


class FuseAllreducePass(PassBase):
    """``ph_fuse_allreduce``: :func:`apply_fuse_allreduce` on each main program and
    :func:`broadcast_parameters` on its startup program.

    Attributes (``new_pass(PASS_NAME, attrs)``): ``params_grads`` and ``nranks`` are required;
    ``max_group_mb``, ``max_group_count``, ``fuse``, ``scale_loss_grad`` default to
    :class:`~.plan.FuseAllreduceConfig`'s defaults.  A missing required or an unknown attribute
    raises (Paddle's ``_check_self`` would only skip the pass).  It conflicts with Paddle's own
    ``fuse_all_reduce`` pass (both would reduce the gradients).
    """

    name = PASS_NAME
    REQUIRED = ("params_grads", "nranks")
    OPTIONAL = ("max_group_mb", "max_group_count", "fuse", "scale_loss_grad")
    CONFLICTS = ("fuse_all_reduce",)

    def _type(self):
        return PassType.COMM_OPT

    def config(self) -> FuseAllreduceConfig:
        """The :class:`~.plan.FuseAllreduceConfig` the attributes describe."""
        return FuseAllreduceConfig(**{k: v for k, v in self._attrs.items() if k != "params_grads"})

    def _check_self(self):
        missing = [k for k in self.REQUIRED if k not in self._attrs]
        unknown = [k for k in self._attrs if k not in self.REQUIRED + self.OPTIONAL]
        if missing or unknown:
            raise ValueError(f"{PASS_NAME}: attributes {missing} are required and {unknown} are unknown; it takes "
                             f"{list(self.REQUIRED)} and optionally {list(self.OPTIONAL)}.")
        self.config()  # rejects bad values with the field's message
        return True

    def _check_conflict(self, other_pass):
        return other_pass.name not in self.CONFLICTS

    def _apply_single_impl(self, main_program, startup_program, context):
        layout = apply_fuse_allreduce(main_program, self.get_attr("params_grads"), self.config())
        if startup_program is not None:
            broadcast_parameters(startup_program)
        context.set_attr(PASS_NAME, layout)
