"""Fused gradient all-reduce for static data-parallel programs (legacy IR).

What the rewrite does to the global block of a program whose backward and
optimizer ops are already appended:

1. after the loss-gradient op, ``scale`` by ``1/nranks`` (where Paddle's data
   parallel scales, ``RawProgramOptimizer._insert_loss_grad_ops``);
2. gradients are grouped by dtype, in the order backward finishes them, into
   groups bounded by bytes (``max_group_mb``) and by count
   (``max_group_count``): a group closes at whichever limit is reached first;
   a gradient bigger than the byte limit forms a group of its own;
3. per group, right after the last op that produces one of its gradients::

       ph_coalesce_tensor(copy_data=True, use_align=False)  grads -> fused
       all_reduce(fused, SUM)
       ph_uncoalesce_tensor(grads, fused) -> grads             # copy back

   The copy back makes every later reader of a gradient (optimizer ops,
   clipping) read a value computed *from the reduced fused buffer*: a data
   dependency, not an aliasing assumption.  That is what makes the rewrite
   exact under PIR, where a custom op cannot alias its outputs into the fused
   buffer (``paddle_hybrid.ops``), and it stays correct where it does alias
   (legacy execution on GPU): the op then sees the same address and skips
   the copy.

With ``fuse=False`` every gradient gets its own ``all_reduce`` right after its
last producer (the unfused baseline, same scaling).

Every rank must build identical groups in identical order;
:func:`layout_fingerprint` and :func:`check_layout_across_ranks` check it.
All edits go through :func:`paddle_hybrid.program_edit.deferred_sync`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Sequence

from paddle.base import core, framework
from paddle.utils import unique_name

from .. import ops
from ..program_edit import deferred_sync

__all__ = [
    "FuseAllreduceConfig",
    "GradSlot",
    "Group",
    "FusedLayout",
    "LayoutMismatchError",
    "plan_groups",
    "apply_fuse_allreduce",
    "layout_fingerprint",
    "first_difference",
    "FUSED_PREFIX",
]

FUSED_PREFIX = "ph_fused_grad"
_OP_ROLE = core.op_proto_and_checker_maker.kOpRoleAttrName()
_ROLE_BACKWARD = int(core.op_proto_and_checker_maker.OpRole.Backward)
_ROLE_OPTIMIZE = int(core.op_proto_and_checker_maker.OpRole.Optimize)
_ROLE_LOSS = int(core.op_proto_and_checker_maker.OpRole.Loss)
_REDUCE_SUM = 0  # paddle.distributed.ReduceOp.SUM


class LayoutMismatchError(RuntimeError):
    """Ranks built different gradient groups; running would hang or corrupt."""


@dataclasses.dataclass(frozen=True)
class FuseAllreduceConfig:
    """How gradients are grouped and reduced.

    ``fleet`` users do not build this: the meta optimizer maps the strategy
    (``fuse_all_reduce_ops``, ``fuse_grad_size_in_MB``,
    ``fuse_grad_size_in_num``) onto it.
    """

    nranks: int
    """Number of data-parallel ranks; the loss gradient is scaled by ``1/nranks``."""

    max_group_mb: float = 32.0
    """Byte limit of a group in MiB (``strategy.fuse_grad_size_in_MB``, default 32)."""

    max_group_count: int = 8
    """Gradient-count limit of a group (``strategy.fuse_grad_size_in_num``, default 8)."""

    fuse: bool = True
    """False: one ``all_reduce`` per gradient (the unfused baseline)."""

    ring_id: int = 0
    """Communicator ring of the data-parallel group."""

    scale_loss_grad: bool = True
    """Insert the ``1/nranks`` scale of the loss gradient."""

    def __post_init__(self):
        if not isinstance(self.nranks, int) or self.nranks < 1:
            raise ValueError(f"FuseAllreduceConfig.nranks must be an int >= 1, got {self.nranks!r}.")
        if not (isinstance(self.max_group_mb, (int, float)) and self.max_group_mb > 0):
            raise ValueError(
                f"FuseAllreduceConfig.max_group_mb must be > 0, got {self.max_group_mb!r}; "
                "set strategy.fuse_grad_size_in_MB to a positive number."
            )
        if not isinstance(self.max_group_count, int) or self.max_group_count < 1:
            raise ValueError(
                f"FuseAllreduceConfig.max_group_count must be an int >= 1, got "
                f"{self.max_group_count!r}; set strategy.fuse_grad_size_in_num to a positive int."
            )

    @property
    def max_group_bytes(self) -> int:
        return int(self.max_group_mb * 1024 * 1024)


@dataclasses.dataclass(frozen=True)
class GradSlot:
    """One gradient: its name, shape, dtype name and the index of its last producer."""

    name: str
    shape: tuple
    dtype: str
    producer: int = -1

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.numel * ops.element_size(self.dtype)


@dataclasses.dataclass(frozen=True)
class Group:
    """Gradients reduced by one ``all_reduce``; ``offsets`` are element offsets in the fused buffer."""

    dtype: str
    slots: tuple
    fused_name: str = ""

    @property
    def offsets(self) -> tuple:
        out, acc = [], 0
        for s in self.slots:
            out.append(acc)
            acc += s.numel
        return tuple(out)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    @property
    def insert_after(self) -> int:
        return max(s.producer for s in self.slots)


@dataclasses.dataclass(frozen=True)
class FusedLayout:
    """The groups of one rewritten program, in program order."""

    groups: tuple
    fused: bool
    nranks: int

    @property
    def num_allreduce(self) -> int:
        return len(self.groups)

    def describe(self) -> list:
        """Plain data (names, shapes, dtypes, group boundaries) compared across ranks."""
        return [
            [g.dtype, [(s.name, tuple(s.shape), s.dtype) for s in g.slots]] for g in self.groups
        ]


# --------------------------------------------------------------------------- planning
def plan_groups(slots: Sequence[GradSlot], config: FuseAllreduceConfig) -> list:
    """Group ``slots`` (in the order backward finishes them) by dtype and limits.

    Slots are ordered by ``producer`` (ties keep the given order).  Each dtype
    has one open group; it is closed before adding a slot that would make it
    exceed ``config.max_group_count`` gradients or ``config.max_group_bytes``
    bytes, whichever comes first.  A slot bigger than the byte limit gets a
    group of its own.  With ``config.fuse`` False every slot is its own group.
    Groups are returned ordered by the position of their all_reduce.
    """
    order = sorted(range(len(slots)), key=lambda i: (slots[i].producer, i))
    closed: list = []  # (creation index, [slots])
    open_by_dtype: dict = {}
    counter = 0
    for i in order:
        s = slots[i]
        if not config.fuse:
            closed.append((counter, [s]))
            counter += 1
            continue
        cur = open_by_dtype.get(s.dtype)
        if cur is not None:
            members = cur[1]
            too_many = len(members) + 1 > config.max_group_count
            too_big = sum(m.nbytes for m in members) + s.nbytes > config.max_group_bytes
            if too_many or too_big:
                closed.append(cur)
                cur = None
        if cur is None:
            cur = (counter, [])
            counter += 1
            open_by_dtype[s.dtype] = cur
        cur[1].append(s)
    closed.extend(open_by_dtype.values())
    groups = [Group(dtype=m[0].dtype, slots=tuple(m)) for _, m in sorted(closed, key=lambda c: c[0])]
    # position of each all_reduce: after the group's last producer; ties keep creation order
    return sorted(groups, key=lambda g: g.insert_after)


# --------------------------------------------------------------------------- fingerprint
def layout_fingerprint(layout: FusedLayout) -> str:
    """SHA-256 of the layout's names, shapes, dtypes and group boundaries."""
    return hashlib.sha256(repr((layout.fused, layout.describe())).encode()).hexdigest()


def first_difference(a: list, b: list) -> str:
    """Human-readable first difference of two :meth:`FusedLayout.describe` results."""
    flat_a = [(gi, g[0], s) for gi, g in enumerate(a) for s in g[1]]
    flat_b = [(gi, g[0], s) for gi, g in enumerate(b) for s in g[1]]
    for k, (x, y) in enumerate(zip(flat_a, flat_b)):
        if x != y:
            return (
                f"gradient #{k}: {x[2][0]!r} shape {list(x[2][1])} {x[2][2]} in group {x[0]} vs "
                f"{y[2][0]!r} shape {list(y[2][1])} {y[2][2]} in group {y[0]}"
            )
    if len(flat_a) != len(flat_b):
        k = min(len(flat_a), len(flat_b))
        extra = (flat_a if len(flat_a) > k else flat_b)[k]
        return f"gradient #{k}: {extra[2][0]!r} exists on one rank only ({len(flat_a)} vs {len(flat_b)} gradients)"
    return "group boundaries differ" if a != b else "no difference"


# --------------------------------------------------------------------------- rewrite
def _role(op) -> int:
    return int(op.all_attrs()[_OP_ROLE]) if _OP_ROLE in op.attr_names else 0


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
    first_bwd = next((i for i, op in enumerate(ops_list) if _role(op) & _ROLE_BACKWARD), None)
    if first_bwd is None:
        raise ValueError(
            "fuse_allreduce: the program has no backward ops; call the optimizer's minimize "
            "(or append_backward) before the rewrite."
        )
    first_opt = next(
        (i for i, op in enumerate(ops_list) if i >= first_bwd and _role(op) & _ROLE_OPTIMIZE), len(ops_list)
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
        role = _role(op)
        if role & _ROLE_BACKWARD and role & _ROLE_LOSS:
            name = op.output_arg_names[0]
            block._insert_op_without_sync(
                idx + 1,
                type="scale",
                inputs={"X": [name]},
                outputs={"Out": [name]},
                attrs={"scale": 1.0 / nranks, _OP_ROLE: _ROLE_BACKWARD},
            )
            return
    raise ValueError("fuse_allreduce: no loss-gradient op found (op_role Backward|Loss); was backward appended?")


def _insert_group(block, pos: int, group: Group, ring_id: int) -> Group:
    """Insert the ops of one group at ``pos``; returns the group with its fused name."""
    role = {_OP_ROLE: _ROLE_BACKWARD}
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
            attrs={"ring_id": ring_id, "reduce_type": _REDUCE_SUM, **role},
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


def _insert_single(block, pos: int, group: Group, ring_id: int) -> Group:
    name = group.slots[0].name
    block._insert_op_without_sync(
        pos,
        type="all_reduce",
        inputs={"x": [name]},
        outputs={"out": [name]},
        attrs={"ring_id": ring_id, "reduce_type": _REDUCE_SUM, _OP_ROLE: _ROLE_BACKWARD},
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
                placed[gi] = _insert_group(block, pos, g, config.ring_id)
            else:
                placed[gi] = _insert_single(block, pos, g, config.ring_id)
    layout = FusedLayout(tuple(placed), bool(config.fuse), config.nranks)
    program._ph_fused_allreduce = layout
    return layout
