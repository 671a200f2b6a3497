"""The probe's figures for static programs (``dist.to_static``, fleet's static pipeline, ``Engine.fit``).

A static program has no eager optimizer step, no ``backward()`` call and no saved-tensor hooks: its
optimizer is applied once, while the program is built, and every step is one ``Executor.run`` of it.
So here:

- **a step** is an ``Executor.run`` of a program that holds an optimizer op (op role 2, Paddle's
  ``OpRole.Optimize``); the first and second such runs play the dygraph probe's first and second
  updates (the peak window, the step's wall time);
- **parameters** and **optimizer state** are read from the scope the program ran in, after the first
  step (their names from the program and from the optimizers that built it: the accumulators and
  master weights), each by this rank's local tensor;
- **gradients** are what the program's optimizer ops read as their gradient, by the shapes and dtypes
  the program that ran gives them (after the auto-parallel partition, this rank's local shapes);
- **activations** are what the program keeps for backward: every value a forward op makes that a
  backward op reads (persistable values aside), by its static shape, times the microbatches of a step
  (``microbatches``: the accumulate steps of a pipeline or gradient merge, else 1).  A value of an
  unknown dimension (``-1``) cannot be sized: it is counted in ``activations_unsized`` and left out
  of the bytes, never guessed.
"""
from __future__ import annotations

import math

__all__ = ["activations", "gradients", "is_pir", "is_training", "micro_batch_size", "microbatches",
           "parameter_names", "rank_program", "scope_bytes", "state_names"]

_OPTIMIZE = 2  # Paddle's OpRole.Optimize (a bit of the legacy op_role attribute; PIR's op_role value)
_FORWARD, _BACKWARD = 0, 1


def is_pir(program) -> bool:
    return not hasattr(program, "current_block_idx")  # a legacy Program keeps block indices; a PIR one does not


def _ops(program) -> list:
    return list(program.global_block().ops)


def rank_program(program):
    """The program this rank runs of ``program``: a legacy pipeline's section (fleet's
    ``_pipeline_opt``; the whole program runs nowhere, each rank runs its stage's section), else
    ``program``."""
    opt = getattr(program, "_pipeline_opt", None)
    section = opt.get("section_program") if isinstance(opt, dict) else None
    return section if section is not None else program


def _role(op, pir: bool) -> int:
    if pir:
        return int(op.op_role)
    return int(op.attr("op_role")) if op.has_attr("op_role") else 0


def is_training(program) -> bool:
    """Whether ``program`` updates parameters (holds an optimizer op)."""
    if program is None or not hasattr(program, "global_block"):
        return False
    pir = is_pir(program)
    if pir:
        return any(_role(op, True) == _OPTIMIZE for op in _ops(program))
    return any(_role(op, False) & _OPTIMIZE and not _role(op, False) & 0x0010 for op in _ops(program))  # not LRSched


def parameter_names(program) -> list:
    return [p.name for p in program.global_block().all_parameters()]


# What an optimizer op reads that is not its state (PIR's input names; the legacy IR's capitalized).
_NOT_STATE = {"param", "grad", "learning_rate", "skip_update", "found_inf", "master_grad"}


def state_names(program) -> list:
    """Names of the optimizer state ``program``'s optimizer ops keep (moments, beta powers, master
    weights: every persistable input but a parameter, a gradient and the learning rate; sharding's
    update may read a slice of its parameter, not the parameter itself)."""
    pir, names = is_pir(program), []
    parameters = set(parameter_names(program))
    block = program.global_block()
    for op in _ops(program):
        if not _role(op, pir) & _OPTIMIZE:
            continue
        if pir:
            for index, input_name in enumerate(op.get_input_names()):
                if input_name in _NOT_STATE:
                    continue
                value = op.operand_source(index)
                name = _name(value) if _sized(value) and getattr(value, "persistable", False) else None
                if name and name not in names and name not in parameters:
                    names.append(name)
        else:
            for input_name in op.input_names:
                if input_name.lower() in _NOT_STATE:
                    continue
                for name in op.input(input_name):
                    var = block.vars.get(name)
                    if var is not None and var.persistable and name not in names and name not in parameters:
                        names.append(name)
    return names


def _name(value) -> str | None:
    try:  # PIR names only parameters, data and a few others
        return value.name
    except ValueError:
        return None


def _dtype_name(dtype) -> str:
    text = str(dtype).replace("paddle.", "").replace("DataType.", "").replace("VarType.", "").lower()
    return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}.get(text, text)


_ELEMENT_BYTES = {"float64": 8, "int64": 8, "complex64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2,
                  "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex128": 16}


def _element_size(dtype) -> int:
    # a table, not a tensor: this runs while a static program is the current one, where any op is built into it
    name = _dtype_name(dtype)
    if name not in _ELEMENT_BYTES:
        raise ValueError(f"paddle_hybrid.dryrun: no element size known for dtype {name}")
    return _ELEMENT_BYTES[name]


def scope_bytes(scope, names) -> dict:
    """Bytes by dtype of the tensors ``names`` hold in ``scope`` (a name it lacks counts nothing)."""
    out = {}
    for name in names:
        var = scope.find_var(name)
        if var is None:
            continue
        tensor = var.get_tensor()
        if not tensor._is_initialized():
            continue
        key = _dtype_name(tensor._dtype())
        out[key] = out.get(key, 0) + math.prod(tensor.shape()) * _element_size(tensor._dtype())
    return out


def _local_shape(value) -> list:
    if hasattr(value, "is_dist") and value.is_dist():
        return list(value._local_shape)
    return list(value.shape)


def _value_bytes(value, batch: int | None = None) -> int | None:
    """Bytes of ``value`` by its static shape; a leading ``-1`` (the batch) is ``batch`` where known,
    any other unknown dimension leaves it unsized (None)."""
    shape = _local_shape(value)
    if 0 in shape:  # an XShape (a reshape's record of its input's shape) or an empty tensor: no data
        return 0
    if shape and shape[0] < 0 and batch:
        shape = [batch] + shape[1:]
    if any(d < 0 for d in shape):
        return None
    return math.prod(shape) * _element_size(value.dtype)


def gradients(program) -> dict:
    """Bytes by dtype of the gradients ``program``'s optimizer ops read (their ``grad`` input), as the
    program that ran shapes them (after the auto-parallel partition: this rank's local shapes)."""
    out = {}
    for value in _optimizer_gradients(program):
        size = _value_bytes(value)
        if size is not None:
            key = _dtype_name(value.dtype)
            out[key] = out.get(key, 0) + size
    return out


def _optimizer_gradients(program) -> list:
    pir, found, seen = is_pir(program), [], set()
    block = program.global_block()
    for op in _ops(program):
        if not _role(op, pir) & _OPTIMIZE:
            continue
        if pir:
            names = op.get_input_names()
            if "grad" in names:
                value = op.operand_source(names.index("grad"))
                if _sized(value) and id(value) not in seen:
                    seen.add(id(value))
                    found.append(value)
        elif "Grad" in op.input_names:
            for name in op.input("Grad"):
                if name not in seen and name in block.vars:
                    seen.add(name)
                    found.append(block.vars[name])
    return found


def _sized(value) -> bool:
    """A PIR value with a tensor type (an optional operand or result left empty has none)."""
    if not value.initialized() or not value.type():
        return False
    return value.is_dense_tensor_type() or (hasattr(value, "is_dist") and value.is_dist())


def activations(program, micro_batch_size: int | None = None) -> tuple:
    """``(bytes by kind, unsized)``: what one run of ``program``'s forward keeps for its backward (see
    the module docstring); kinds as the dygraph probe's (``square:<dtype>`` for ``[b, heads, s, s]``
    tensors, ``other:<dtype>``)."""
    kept = _kept_for_backward_pir(program) if is_pir(program) else _kept_for_backward_legacy(program)
    by_kind, unsized = {}, 0
    batch = micro_batch_size
    for value in kept:
        size = _value_bytes(value, batch)
        if size is None:
            unsized += 1
            continue
        shape = _local_shape(value)
        kind = "square" if len(shape) >= 4 and shape[-1] == shape[-2] > 1 else "other"
        key = f"{kind}:{_dtype_name(value.dtype)}"
        by_kind[key] = by_kind.get(key, 0) + size
    return by_kind, unsized


def _kept_for_backward_pir(program) -> list:
    kept = []
    for op in _ops(program):
        if _role(op, True) != _FORWARD or op.name() in ("builtin.parameter", "pd_op.data", "builtin.constant"):
            continue
        for value in op.results():
            if not _sized(value) or getattr(value, "persistable", False):
                continue
            if any(_role(user, True) == _BACKWARD for user in value.all_used_ops()):
                kept.append(value)
    return kept


def _kept_for_backward_legacy(program) -> list:
    block = program.global_block()
    made_forward, kept, seen = set(), [], set()
    for op in block.ops:
        role = _role(op, False)
        if role == _FORWARD or role == 256:  # Forward, or the loss op (OpRole.Loss)
            made_forward.update(op.output_arg_names)
        elif role & _BACKWARD:
            for name in op.input_arg_names:
                var = block.vars.get(name)
                if name in made_forward and name not in seen and var is not None and not var.persistable:
                    seen.add(name)
                    kept.append(var)
    return kept


def micro_batch_size(program) -> int | None:
    """A legacy pipeline program's micro-batch (fleet's ``_pipeline_opt``), which its ``-1`` batch
    dimensions take at run time; None elsewhere."""
    opt = getattr(program, "_pipeline_opt", None)
    if not isinstance(opt, dict):
        return None
    size = opt.get("micro_batch_size") or opt.get("ph_micro_batch_size")
    return int(size) if size else None


def microbatches(program) -> int:
    """Microbatches a step runs a legacy pipeline program's forward for (fleet's ``_pipeline_opt``), else 1
    (a PIR plan's count comes from the executor's plan)."""
    opt = getattr(program, "_pipeline_opt", None)
    if isinstance(opt, dict):
        for key in ("accumulate_steps", "num_microbatches"):
            if opt.get(key):
                return int(opt[key])
    return 1
