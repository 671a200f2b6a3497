"""The plugin's custom C++ ops: ``nop`` and ``coalesce_tensor``.

This module is the one place that loads the compiled library
(``paddle_hybrid/_custom_ops.so``, built by ``setup.py`` from ``custom_ops/``).

The ops are registered as ``ph_nop`` and ``ph_coalesce_tensor``.  Paddle already
has built-in ``nop`` and ``coalesce_tensor``; a custom op of the same name would
replace the built-in for the whole process and break Paddle's own passes, so the
plugin's ops carry the ``ph_`` prefix and both kinds coexist.

Modes:

* dygraph, legacy static programs and PIR programs all run both ops;
* ``coalesce_tensor`` outputs alias the fused buffer in dygraph and in legacy
  static programs (a write through either is seen by the other);
* under PIR a custom op cannot make its outputs alias another buffer, so
  :func:`coalesce_tensor` raises :class:`PirAliasingError` there instead of
  returning views that silently are not views.  A legacy program holding a
  ``ph_coalesce_tensor`` op keeps running after translation to PIR with *copy
  semantics*: ``FusedOutput`` is a packed copy with the same layout and
  ``Output`` keeps the input values; passes that execute through PIR copy
  results back explicitly (see ``paddle_hybrid.static.fused_allreduce``).
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Sequence

# The start of the warning Paddle's cpp_extension module gives when it is imported on a machine
# without ccache (a regex for warnings.filterwarnings, matched at the message's start).
CCACHE_WARNING = r"No ccache found"

with warnings.catch_warnings():
    # `import paddle` imports paddle.utils.cpp_extension (the builder of custom ops), which looks for
    # ccache, a compiler cache, and warns when there is none.  This module is where the plugin
    # imports Paddle first, and the plugin compiles nothing at import (it loads its library built
    # beforehand), so that one warning is silenced here; a process that imported Paddle before the
    # plugin has seen it already.
    warnings.filterwarnings("ignore", message=CCACHE_WARNING, category=UserWarning)
    import paddle
    from paddle import _C_ops
    from paddle.base import framework

__all__ = [
    "NOP_OP",
    "NOP_IN",
    "NOP_OUT",
    "COALESCE_OP",
    "COALESCE_IN",
    "COALESCE_OUT",
    "COALESCE_FUSED",
    "UNCOALESCE_OP",
    "UNCOALESCE_IN",
    "UNCOALESCE_FUSED",
    "UNCOALESCE_OUT",
    "uncoalesce_tensor",
    "PirAliasingError",
    "nop",
    "coalesce_tensor",
    "coalesce_attrs",
    "dtype_name",
    "element_size",
    "library_path",
]

NOP_OP = "ph_nop"
UNBACKED_OP = "ph_unbacked"
COALESCE_OP = "ph_coalesce_tensor"
# Slot names of the ops in legacy programs (custom-op vector slots carry
# Paddle's "@VECTOR" suffix): use them with Block._insert_op_without_sync.
NOP_IN, NOP_OUT = "X@VECTOR", "Out@VECTOR"
COALESCE_IN, COALESCE_OUT, COALESCE_FUSED = "Input@VECTOR", "Output@VECTOR", "FusedOutput"
UNCOALESCE_OP = "ph_uncoalesce_tensor"
UNCOALESCE_IN, UNCOALESCE_FUSED, UNCOALESCE_OUT = "X@VECTOR", "Fused", "Out@VECTOR"

_LIB_NAME = "_custom_ops.so"
# How the compiled libraries are built in place, as messages say it.  ``--use-pep517``: with
# setuptools 80 or newer and a pip older than 25, an editable install otherwise runs setuptools'
# ``develop``, which calls pip again without ``--no-build-isolation`` (no Paddle to build against).
BUILD_COMMAND = "pip install --no-build-isolation --use-pep517 -e ."
_DTYPE_SIZES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}


class PirAliasingError(RuntimeError):
    """``coalesce_tensor`` was asked for views under PIR, where a custom op
    cannot alias its outputs."""


def library_path() -> str:
    """Path of the compiled op library inside the installed package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), _LIB_NAME)


def _load() -> list:
    path = library_path()
    if not os.path.exists(path):
        raise ImportError(
            f"paddle_hybrid: the compiled custom ops ({_LIB_NAME}) are missing. Build them "
            f"from the repository root with `{BUILD_COMMAND}` "
            "(or run `bash scripts/test.sh`, which sets everything up)."
        )
    from paddle.utils.cpp_extension.extension_utils import load_op_meta_info_and_register_op

    names = load_op_meta_info_and_register_op(path)
    missing = {NOP_OP, COALESCE_OP, UNCOALESCE_OP, UNBACKED_OP, "ph_use_ring", "ph_send_v2", "ph_recv_v2"} - set(names)
    if missing:
        raise ImportError(
            f"paddle_hybrid: {path} registered {sorted(names)} but not {sorted(missing)}; "
            f"rebuild with `{BUILD_COMMAND}`."
        )
    return names


REGISTERED_OPS = _load()


# --------------------------------------------------------------------------- helpers
def dtype_name(dtype) -> str:
    """Canonical name ('float32', 'bfloat16', ...) of any Paddle/NumPy dtype."""
    if isinstance(dtype, str):
        name = dtype
    else:
        from paddle.base.data_feeder import convert_dtype

        name = convert_dtype(dtype)
    if name == "uint16":  # Paddle spells bfloat16 as uint16 in NumPy terms
        name = "bfloat16"
    if name not in _DTYPE_SIZES:
        raise TypeError(
            f"paddle_hybrid: dtype {dtype!r} is not supported; use one of {sorted(_DTYPE_SIZES)}."
        )
    return name


def element_size(dtype) -> int:
    return _DTYPE_SIZES[dtype_name(dtype)]


def _mode() -> str:
    if framework.in_dygraph_mode():
        return "dygraph"
    if framework.in_pir_mode():
        return "pir"
    return "legacy"


def _check_tensors(tensors, fn: str) -> list:
    if isinstance(tensors, (paddle.Tensor, framework.Variable, paddle.pir.Value)):
        tensors = [tensors]
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"paddle_hybrid.ops.{fn}: got an empty list of tensors; pass at least one.")
    for i, t in enumerate(tensors):
        if isinstance(t, paddle.Tensor):
            if not t.is_dense():
                raise TypeError(
                    f"paddle_hybrid.ops.{fn}: tensor {i} is not dense "
                    f"(sparse or selected rows); convert it with .to_dense() first."
                )
        elif not isinstance(t, (framework.Variable, paddle.pir.Value)):
            raise TypeError(
                f"paddle_hybrid.ops.{fn}: item {i} is a {type(t).__name__}, not a Paddle tensor."
            )
        elif isinstance(t, framework.Variable) and t.type not in (
            paddle.base.core.VarDesc.VarType.DENSE_TENSOR,
        ):
            raise TypeError(
                f"paddle_hybrid.ops.{fn}: variable {t.name!r} is of type {t.type}, not a dense "
                "tensor; only dense tensors are supported."
            )
    return tensors


class _InplaceAllowed:
    """Lets an in-place custom op run on leaf tensors that require grad.

    Paddle refuses in-place ops on such leaves because autograd could not see
    the write; ``ph_nop`` writes nothing and ``ph_coalesce_tensor`` only moves
    storage (values are preserved with ``copy_data``), so the flag is lifted for
    the call and restored afterwards, also on error.
    """

    def __init__(self, tensors):
        self._tensors = [t for t in tensors if not t.stop_gradient]

    def __enter__(self):
        for t in self._tensors:
            t.stop_gradient = True
        return self

    def __exit__(self, *exc):
        for t in self._tensors:
            t.stop_gradient = False
        return False


def coalesce_attrs(
    dtype: str,
    copy_data: bool = False,
    set_constant: bool = False,
    constant: float = 0.0,
    use_align: bool = True,
    align_size: int = -1,
) -> dict:
    """Validated attribute dict of a ``ph_coalesce_tensor`` op.

    For passes that insert the op by type into a legacy program
    (``block._insert_op_without_sync(i, type=COALESCE_OP, ...)``).
    """
    name = dtype_name(dtype)
    size = _DTYPE_SIZES[name]
    if not isinstance(align_size, int) or isinstance(align_size, bool):
        raise TypeError(f"paddle_hybrid: align_size must be an int, got {align_size!r}.")
    if align_size != -1 and (align_size <= 0 or align_size % size):
        raise ValueError(
            f"paddle_hybrid: align_size={align_size} is not a positive multiple of the element "
            f"size of {name} ({size} bytes); use -1 for the device default or a multiple of {size}."
        )
    return {
        "dtype": name,
        "copy_data": bool(copy_data),
        "set_constant": bool(set_constant),
        "constant": float(constant),
        "use_align": bool(use_align),
        "align_size": int(align_size),
    }


# --------------------------------------------------------------------------- nop
def nop(*tensors):
    """In place, does nothing; returns its inputs (one tensor, or a tuple).

    Keeps variables alive up to its position in a static program and adds a
    dependency edge.  Works for every dtype in dygraph, legacy static programs
    and PIR.  In PIR the returned values are the op's (in-place) results.
    """
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    ts = _check_tensors(tensors, "nop")
    mode = _mode()
    if mode == "dygraph":
        with paddle.no_grad(), _InplaceAllowed(ts):
            _C_ops._run_custom_op(NOP_OP, ts)
        out = ts
    elif mode == "pir":
        out = _C_ops._run_custom_op(NOP_OP, ts)
        out = list(out[0]) if len(out) == 1 and isinstance(out[0], (list, tuple)) else list(out)
    else:
        block = framework.default_main_program().current_block()
        block.append_op(type=NOP_OP, inputs={NOP_IN: ts}, outputs={NOP_OUT: ts})
        out = ts
    return out[0] if len(out) == 1 else tuple(out)


# --------------------------------------------------------------------------- unbacked
def unbacked(shape, dtype):
    """A dygraph CPU tensor of ``shape`` and ``dtype`` whose holder says it has the bytes and owns
    none (its data pointer is null; nothing is allocated).  For a tensor no kernel will read: what
    the dry run's probe gives back for a DistTensor a semi-auto op saved on a rank outside its
    mesh (``custom_ops/unbacked.cc`` says why)."""
    like = paddle.empty([0], dtype=dtype)
    with paddle.no_grad():
        return _C_ops._run_custom_op(UNBACKED_OP, like, [int(d) for d in shape])[0]


# --------------------------------------------------------------------------- coalesce_tensor
def coalesce_tensor(
    tensors: Sequence,
    dtype=None,
    copy_data: bool = False,
    set_constant: bool = False,
    constant: float = 0.0,
    use_align: bool = True,
    align_size: int = -1,
):
    """Pack ``tensors`` into one fused 1-D buffer; returns ``(outputs, fused)``.

    Same semantics and layout (offsets, alignment, fused numel) as Paddle's
    built-in ``coalesce_tensor`` for the same arguments:

    * ``outputs[i]`` is a view of ``fused`` with ``tensors[i]``'s shape, at an
      offset rounded up to ``align_size`` bytes when ``use_align`` (``-1``: the
      device's minimum chunk, 4 KiB on CPU, 256 B on GPU);
    * ``copy_data=True`` copies the inputs' values into ``fused`` (padding is
      zeroed); else ``set_constant=True`` fills ``fused`` with ``constant``;
      else ``fused`` is uninitialised;
    * ``dtype`` (default: the inputs' common dtype) is the fused buffer's dtype;
      with ``copy_data`` every input must already have it.

    In dygraph the inputs themselves become the views (like the built-in op).
    Empty inputs (numel 0) are allowed and take no space (the built-in rejects
    them).  Under PIR this raises :class:`PirAliasingError` (see module doc).
    """
    ts = _check_tensors(tensors, "coalesce_tensor")
    # checks: one dtype, and with copy_data the bytes can be copied as they are
    attrs = coalesce_attrs(_common_dtype(ts) if dtype is None else dtype, copy_data, set_constant, constant,
                           use_align, align_size)
    if copy_data:
        _check_copyable(ts, attrs["dtype"])
    mode = _mode()
    if mode == "pir":
        raise PirAliasingError(
            "paddle_hybrid.ops.coalesce_tensor: under PIR a custom op cannot make its outputs "
            "alias the fused buffer, so the views this function promises cannot be built. "
            "Build the program under the legacy IR (paddle.pir_utils.OldIrGuard() or "
            "FLAGS_enable_pir_api=0) or use dygraph; in a PIR program use Paddle's built-in "
            "paddle._C_ops.coalesce_tensor."
        )
    if mode == "dygraph":
        return list(ts), _coalesce_dygraph(ts, attrs)
    return list(ts), _append_coalesce_op(ts, attrs)


def _common_dtype(ts) -> str:
    names = [dtype_name(t.dtype) for t in ts]
    for i, n in enumerate(names):
        if n != names[0]:
            raise ValueError(
                f"paddle_hybrid.ops.coalesce_tensor: tensor {i} is {n} but tensor 0 is "
                f"{names[0]}; pass dtype= explicitly or coalesce each dtype separately."
            )
    return names[0]


def _check_copyable(ts, dtype: str) -> None:
    for i, t in enumerate(ts):
        if dtype_name(t.dtype) != dtype:
            raise ValueError(
                f"paddle_hybrid.ops.coalesce_tensor: tensor {i} is {dtype_name(t.dtype)} but "
                f"dtype={dtype}; copy_data=True copies bytes, so cast it first."
            )


def _coalesce_dygraph(ts, attrs):
    """Run the op now: the inputs themselves become the views; returns the fused buffer."""
    if attrs["copy_data"]:
        for i, t in enumerate(ts):
            if math.prod(t.shape) > 0 and not t._is_initialized():
                raise ValueError(
                    f"paddle_hybrid.ops.coalesce_tensor: tensor {i} is not initialised but "
                    "copy_data=True; initialise it or pass copy_data=False."
                )
    args = [attrs[k] for k in ("dtype", "copy_data", "set_constant", "constant", "use_align", "align_size")]
    with paddle.no_grad(), _InplaceAllowed(ts):
        res = _C_ops._run_custom_op(COALESCE_OP, ts, *args)
    return res[-1]


def _append_coalesce_op(ts, attrs):
    """Legacy static: append the op to the current block; returns the fused variable."""
    block = framework.default_main_program().current_block()
    fused = block.create_var(
        name=paddle.utils.unique_name.generate("ph_coalesce_fused"),
        dtype=attrs["dtype"] if attrs["dtype"] != "bfloat16" else paddle.bfloat16,
        shape=[-1],
        persistable=False,
        stop_gradient=True,
    )
    block.append_op(
        type=COALESCE_OP,
        inputs={COALESCE_IN: ts},
        outputs={COALESCE_OUT: ts, COALESCE_FUSED: [fused]},
        attrs=attrs,
    )
    return fused


# --------------------------------------------------------------------------- uncoalesce_tensor
def uncoalesce_tensor(fused, tensors: Sequence, use_align: bool = True, align_size: int = -1):
    """Copy each tensor's slice of ``fused`` back into the tensor, in place;
    returns the tensors (in PIR: the op's in-place results).

    The inverse of :func:`coalesce_tensor` with the same ``use_align`` /
    ``align_size``: offsets are the ones ``coalesce_tensor`` gave.  Where the
    tensors already alias ``fused`` (dygraph, legacy static) the copy is
    skipped; under PIR, where they cannot alias, this is how writes through the
    fused buffer reach the tensors, with a data dependency on ``fused``.
    Every mode; every tensor must be initialised and have ``fused``'s dtype.
    """
    ts = _check_tensors(tensors, "uncoalesce_tensor")
    (fused_checked,) = _check_tensors([fused], "uncoalesce_tensor")
    attrs = coalesce_attrs(fused_checked.dtype, use_align=use_align, align_size=align_size)
    want = attrs["dtype"]
    for i, t in enumerate(ts):
        if dtype_name(t.dtype) != want:
            raise ValueError(
                f"paddle_hybrid.ops.uncoalesce_tensor: tensor {i} is {dtype_name(t.dtype)} but the fused "
                f"buffer is {want}; pass the tensors that were coalesced into it."
            )
    mode = _mode()
    args = [attrs["use_align"], attrs["align_size"]]
    if mode == "dygraph":
        with paddle.no_grad(), _InplaceAllowed(ts):
            _C_ops._run_custom_op(UNCOALESCE_OP, ts, fused, *args)
        return list(ts)
    if mode == "pir":
        out = _C_ops._run_custom_op(UNCOALESCE_OP, ts, fused, *args)
        return list(out[0]) if len(out) == 1 and isinstance(out[0], (list, tuple)) else list(out)
    block = framework.default_main_program().current_block()
    block.append_op(
        type=UNCOALESCE_OP,
        inputs={UNCOALESCE_IN: ts, UNCOALESCE_FUSED: [fused]},
        outputs={UNCOALESCE_OUT: ts},
        attrs={"use_align": attrs["use_align"], "align_size": attrs["align_size"]},
    )
    return list(ts)
