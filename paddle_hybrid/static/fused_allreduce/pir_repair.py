"""Running legacy programs that hold the plugin's ops through PIR.

Paddle 3.3.1's legacy->PIR translator (``paddle.pir.translate_to_pir``) maps a
custom op's in-place *vector* output to a single tensor: a translated
``ph_coalesce_tensor`` comes out as ``(tensor, fused)`` instead of
``(vec[tensor...], fused)`` and execution fails ("The Variable type must be
PhiVector ..." or "InferShapeFunc ... expected 2 Tensors' shape").

:func:`repair_custom_vector_ops` rebuilds each such op in place with the PIR
Python API (``paddle._C_ops._run_custom_op``, which builds the op correctly
with ``builtin.combine`` / ``builtin.split``), rewires the uses of the broken
op's results to the new ones and erases the broken op.  It changes nothing in
a program without broken ops, so it is safe to call twice.

Every block is repaired, the sub-blocks of control flow (``pd_op.if``,
``pd_op.while``) included.  Nothing in Paddle is patched: the repair is applied
to a translated program by :mod:`.runner`.
"""
from __future__ import annotations

import paddle
from paddle import _C_ops

from ... import ops

__all__ = ["repair_custom_vector_ops", "translate_with_repair"]

_REPAIRABLE = {
    # PIR op name -> (custom op name, attribute order of its Python builder)
    f"custom_op.{ops.COALESCE_OP}_": (
        ops.COALESCE_OP,
        ("dtype", "copy_data", "set_constant", "constant", "use_align", "align_size"),
    ),
    f"custom_op.{ops.NOP_OP}_": (ops.NOP_OP, ()),
    f"custom_op.{ops.UNCOALESCE_OP}_": (ops.UNCOALESCE_OP, ("use_align", "align_size")),
}


def _is_broken(op) -> bool:
    """True when the op's first result is not a vector although its input is."""
    return op.num_results() >= 1 and not op.result(0).is_combine() and op.operand_source(0).is_combine()


def repair_custom_vector_ops(program, name_to_values: dict | None = None) -> int:
    """Rebuild every mis-translated ``ph_coalesce_tensor`` / ``ph_nop`` /
    ``ph_uncoalesce_tensor`` op of
    ``program`` (a PIR program); returns how many were rebuilt.

    ``name_to_values`` (the mapping of ``translate_to_pir_with_param_map``) is
    updated in place so that no name points at a result of an erased op.
    """
    if not isinstance(program, paddle.pir.Program):
        raise TypeError(
            f"repair_custom_vector_ops: expected a paddle.pir.Program, got {type(program).__name__}; "
            "translate a legacy program with paddle.pir.translate_to_pir first."
        )
    repaired = 0
    for block in _all_blocks(program.global_block()):
        for op in list(block.ops):
            spec = _REPAIRABLE.get(op.name())
            if spec is None or not _is_broken(op):
                continue
            name, attr_order = spec
            combine = op.operand_source(0).get_defining_op()
            inputs = [combine.operand_source(i) for i in range(combine.num_operands())]
            extra = [op.operand_source(i) for i in range(1, op.num_operands())]
            attrs = op.attrs()
            later = _ops_after(block, op)
            with paddle.pir_utils.IrGuard(), paddle.static.program_guard(program):
                paddle.pir.set_insertion_point(op)
                new = _C_ops._run_custom_op(name, inputs, *extra, *[attrs[a] for a in attr_order])
                paddle.pir.reset_insertion_point_to_end()
            new = list(new)
            n_vec = len(inputs)
            new_vec, new_rest = new[:n_vec], new[n_vec:]
            old = op.results()
            # broken layout: result 0 stands for the first vector element,
            # the remaining results are the op's non-vector outputs
            pairs = [(old[0], new_vec[0])] + list(zip(old[1:], new_rest))
            for o, n in pairs:
                o.replace_all_uses_with(n)
            # The translator bound only the first vector name to the broken
            # op; later readers of the other names still read the values from
            # before it.  Point them at the op's in-place results.
            for k in range(1, n_vec):
                _rewire_later_uses(inputs[k], new_vec[k], later)
                if name_to_values:
                    for values in name_to_values.values():
                        if values and values[-1].is_same(inputs[k]):
                            values.append(new_vec[k])
            if name_to_values:
                for values in name_to_values.values():
                    for k, v in enumerate(values):
                        for o, n in pairs:
                            if v.is_same(o):
                                values[k] = n
            op.erase()
            if combine.result(0).use_empty():
                combine.erase()
            repaired += 1
    return repaired


def _all_blocks(block) -> list:
    """``block`` and every block nested in its ops (control-flow regions), outermost first."""
    out = [block]
    for op in block.ops:
        for sub in op.blocks():
            out.extend(_all_blocks(sub))
    return out


def _ops_after(block, op) -> set:
    """Ids of the ops that follow ``op`` in ``block``, with the ops nested in them."""
    ids, seen = set(), False
    for o in block.ops:
        if seen:
            ids.add(o.id())
            for sub in o.blocks():
                ids.update(nested.id() for b in _all_blocks(sub) for nested in b.ops)
        elif o.id() == op.id():
            seen = True
    return ids


def _rewire_later_uses(old, new, later_ids: set) -> None:
    for user in old.all_used_ops():
        if user.id() not in later_ids:
            continue
        for i in range(user.num_operands()):
            if user.operand_source(i).is_same(old):
                user.operand(i).set_source(new)


def translate_with_repair(legacy_program):
    """``translate_to_pir_with_param_map`` + :func:`repair_custom_vector_ops`.

    Returns ``(pir_program, name_to_values)``; the last value of a name is its
    final definition.
    """
    program, mapping = paddle.pir.translate_to_pir_with_param_map(legacy_program.desc)
    repair_custom_vector_ops(program, mapping)
    return program, mapping
