"""The kernels a rank's measured step runs, as the probe records them: what the GPU step estimate prices
(``python -m paddle_hybrid.dryrun --gpu``).

Paddle's dygraph runs an op's forward through ``paddle._C_ops.<op>`` (``F.linear``, ``paddle.matmul``,
``F.softmax``, ``F.layer_norm``, ...); each op of :data:`OPS` is wrapped there and every call in the measured step
(between the first and the second optimizer update) is recorded: the op, its tensor arguments' shapes and
dtypes, whether each needs a gradient, the attributes that change its cost (a matmul's transposes), its
output's shape, and its phase: ``fwd``, ``recompute`` (a forward run again inside a backward) or ``update``
(inside the optimizer's step, or between the step's last backward and it: a sharding optimizer's or a
bucket's gradient concat).  Calls alike are counted, not listed.  Calls after an update and before the next
step's first forward (a sharding optimizer's parameter broadcast) are counted with the step's forwards.

Not seen: backward kernels (Paddle runs them in C++; the estimate derives each from its forward), Tensor
operators written as ``x + y`` (C++ methods; a residual add is a memory-bound op of a layer's size), ops a
module imported by name before the probe was installed.
"""
from __future__ import annotations

__all__ = ["KernelLog", "OPS", "install"]

GEMMS = ("matmul", "linear", "bmm", "mm")
ATTENTION = ("flash_attn", "flash_attn_unpadded", "flashmask_attention", "memory_efficient_attention",
             "flash_attn_qkvpacked", "flash_attn_varlen_qkvpacked")
MEMORY_BOUND = ("softmax", "layer_norm", "rms_norm", "fused_rms_norm", "fused_rms_norm_ext", "gelu", "silu", "swiglu",
                "relu", "dropout", "add", "subtract", "multiply", "divide", "scale", "exp", "tanh", "cast", "embedding",
                "c_embedding", "cross_entropy_with_softmax", "c_softmax_with_cross_entropy", "transpose", "concat",
                "split", "fused_rotary_position_embedding", "where", "masked_fill", "triu", "tril", "sum", "mean",
                "add_n", "pow", "rsqrt", "sqrt", "fused_bias_dropout_residual_layer_norm", "fused_dropout_add")
OPS = GEMMS + ATTENTION + MEMORY_BOUND


def _is_tensor(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "stop_gradient")


def _tensors(values):
    for v in values:
        if _is_tensor(v):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if _is_tensor(t))


def _describe(tensors):
    return (tuple(tuple(int(d) for d in t.shape) for t in tensors),
            tuple(str(t.dtype).replace("paddle.", "") for t in tensors),
            tuple(not t.stop_gradient for t in tensors))


class KernelLog:
    """Counts of the recorded calls of the measured step (see the module docstring)."""

    def __init__(self):
        self.recording = False
        self.in_update = False
        self.in_backward = lambda: False   # the probe's own answer, set at install
        self.calls = {}
        self.since_backward = {}  # calls since the last backward ended: the optimizer's if an update follows

    def backward_ended(self) -> None:
        self.since_backward = {}

    def update_begins(self) -> None:
        """What ran between the step's last backward and its update (a sharding optimizer's or a data-parallel
        bucket's gradient concat) belongs to the update, not to a microbatch."""
        for key, n in self.since_backward.items():
            self.calls[key] -= n
            if not self.calls[key]:
                del self.calls[key]
            moved = key[:6] + ("update",) + key[7:]
            self.calls[moved] = self.calls.get(moved, 0) + n
        self.since_backward = {}

    def record(self, op, args, kwargs, result) -> None:
        import paddle

        inputs = list(_tensors(list(args) + list(kwargs.values())))
        outputs = list(_tensors([result])) if not _is_tensor(result) else [result]
        shapes, dtypes, grads = _describe(inputs)
        attrs = ()
        if op == "matmul":  # matmul(x, y, transpose_x=False, transpose_y=False), positional or by name
            given = list(args[2:4]) + [None] * (2 - len(args[2:4]))
            attrs = tuple(bool(kwargs.get(name, value)) for name, value in zip(("transpose_x", "transpose_y"), given))
        phase = "update" if self.in_update else ("recompute" if self.in_backward() else "fwd")
        key = (op, shapes, dtypes, grads, attrs, tuple(tuple(int(d) for d in o.shape) for o in outputs), phase,
               bool(paddle.is_grad_enabled()))
        self.calls[key] = self.calls.get(key, 0) + 1
        if phase == "fwd":
            self.since_backward[key] = self.since_backward.get(key, 0) + 1

    def as_json(self) -> list:
        return [{"op": k[0], "shapes": [list(s) for s in k[1]], "dtypes": list(k[2]), "needs_grad": list(k[3]),
                 "attrs": list(k[4]), "out_shapes": [list(s) for s in k[5]], "phase": k[6], "grad_enabled": k[7],
                 "calls": n} for k, n in self.calls.items()]


def _wrap(stock, op, log):
    def recorded(*args, **kwargs):
        result = stock(*args, **kwargs)
        if log.recording:
            log.record(op, args, kwargs, result)
        return result

    recorded.__wrapped__ = stock
    return recorded


def install(patcher, log: KernelLog) -> list:
    """Wrap every op of :data:`OPS` that ``paddle._C_ops`` has; the names wrapped."""
    from paddle import _C_ops

    wrapped = []
    for op in OPS:
        stock = getattr(_C_ops, op, None)
        if callable(stock):
            patcher.set(_C_ops, op, _wrap(stock, op, log))
            wrapped.append(op)
    return wrapped
