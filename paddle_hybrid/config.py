"""Configuration of the plugin: every knob in one validated dataclass.

Environment variables are read here and nowhere else (:meth:`PluginConfig.from_env`).
"""
from __future__ import annotations

import dataclasses
import os


__all__ = ["PluginConfig", "ENVIRONMENT", "AUTO_ON_OFF", "TIMEOUT_RANGE"]


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"paddle_hybrid: environment variable {name}={raw!r} is not a boolean; use 1 or 0.")


def _env_tristate(name: str) -> bool | None:
    """Unset or empty: None (the device rule decides); otherwise a boolean."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    return _env_bool(name, False)


def _env_auto_on_off(name: str, default: str) -> str:
    return (os.environ.get(name) or default).strip().lower()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"paddle_hybrid: environment variable {name}={raw!r} is not an integer.") from None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"paddle_hybrid: environment variable {name}={raw!r} is not a number.") from None


# The environment variable of every field (PluginConfig.from_env reads them; messages name them).
ENVIRONMENT = {
    "register_meta_optimizers": "PADDLE_HYBRID_META_OPTIMIZERS",
    "reshard_deferred_sync": "PADDLE_HYBRID_RESHARD_DEFERRED_SYNC",
    "pipeline_send_wait": "PADDLE_HYBRID_PIPELINE_SEND_WAIT",
    "cpu_hybrid": "PADDLE_HYBRID_CPU_HYBRID",
    "expert_parallel": "PADDLE_HYBRID_EXPERT_PARALLEL",
    "fleet_fixes": "PADDLE_HYBRID_FLEET_FIXES",
    "paddleformers_fixes": "PADDLE_HYBRID_PADDLEFORMERS_FIXES",
    "grad_buckets": "PADDLE_HYBRID_GRAD_BUCKETS",
    "grad_bucket_max_params": "PADDLE_HYBRID_GRAD_BUCKET_MAX_PARAMS",
    "static_fuse_allreduce": "PADDLE_HYBRID_STATIC_FUSE_ALLREDUCE",
    "static_layout_check_timeout": "PADDLE_HYBRID_STATIC_LAYOUT_CHECK_TIMEOUT",
    "static_pipeline": "PADDLE_HYBRID_STATIC_PIPELINE",
    "static_pipeline_timeout": "PADDLE_HYBRID_STATIC_PIPELINE_TIMEOUT",
    "auto_parallel_cpu": "PADDLE_HYBRID_AUTO_PARALLEL_CPU",
    "pipeline_cudagraph": "PADDLE_HYBRID_PIPELINE_CUDAGRAPH",
    "allow_unrun": "PADDLE_HYBRID_ALLOW_UNRUN",
    "cuda_graph_warmup_steps": "PADDLE_HYBRID_CUDA_GRAPH_WARMUP_STEPS",
    "cuda_malloc_async": "PADDLE_HYBRID_CUDA_MALLOC_ASYNC",
    "cpu_blas_vendor_fix": "PADDLE_HYBRID_CPU_BLAS",
    "timeline": "PADDLE_HYBRID_TIMELINE",
    "force_unverified": "PADDLE_HYBRID_FORCE",
    "timeout": "PADDLE_HYBRID_TIMEOUT",
    "startup_agreement": "PADDLE_HYBRID_STARTUP_AGREEMENT",
    "store_nodelay": "PADDLE_HYBRID_STORE_NODELAY",
}

# The fields set "auto", "on" or "off" (how each is decided: paddle_hybrid.registry.gate).
AUTO_ON_OFF = ("cpu_hybrid", "expert_parallel", "static_pipeline", "auto_parallel_cpu")

# How from_env reads a field, by its annotation.
_KIND = {"bool": bool, "bool | None": "tristate", "int": int, "float": float, "float | None": "optional_float",
         "str": "auto_on_off"}

DEFAULT_TIMEOUT = 600.0
"""Seconds every wait of the plugin allows by default: a rank may pause for a checkpoint save, an
evaluation or a loaded machine for minutes and the job goes on; a rank that hung is named after
ten minutes (Paddle's own silent wait for a missing group is 15)."""

# Deadlines the user sets: at least a second (the stores and rings count whole seconds, so less
# would become 0: no deadline at all) and at most a day (inf or 1e30 overflow the C++ side).
TIMEOUT_RANGE = (1.0, 86400.0)


def _check_seconds(field: str, value, env: str) -> None:
    low, high = TIMEOUT_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"PluginConfig.{field} must be a number of seconds in [{low:g}, {high:g}], got {value!r} "
                         f"(environment variable {env}).")


@dataclasses.dataclass(frozen=True)
class PluginConfig:
    """What ``import paddle_hybrid`` installs.

    Each field can be set from the environment variable named in its doc.
    """

    register_meta_optimizers: bool = True
    """Add the plugin's meta optimizers to fleet's factory (``PADDLE_HYBRID_META_OPTIMIZERS``)."""

    reshard_deferred_sync: bool = True
    """Legacy auto-parallel ``Resharder.reshard`` edits programs without a ``_sync_with_cpp``
    per inserted op (:mod:`paddle_hybrid.static.reshard`) (``PADDLE_HYBRID_RESHARD_DEFERRED_SYNC``)."""

    pipeline_send_wait: bool | None = None
    """With fleet ``strategy.pipeline`` (static), replace the waits for forward sends by a ``ph_nop``
    after the matching backward recv (:mod:`paddle_hybrid.static.send_wait`)
    (``PADDLE_HYBRID_PIPELINE_SEND_WAIT``).  Tri-state (:mod:`paddle_hybrid.registry.gate`): None
    is on only on a build without an accelerator, True opts in everywhere, False is off."""

    cpu_hybrid: str = "auto"
    """Patch fleet so dygraph hybrid parallel runs on CPU over gloo (:mod:`paddle_hybrid.dygraph.cpu`):
    ``"auto"`` when Paddle is not compiled with CUDA, ``"on"`` always, ``"off"`` never
    (``PADDLE_HYBRID_CPU_HYBRID``)."""

    expert_parallel: str = "auto"
    """Expert parallelism on CPU over gloo (:mod:`paddle_hybrid.dygraph.expert_parallel`): the gloo
    all-to-all family, ``global_scatter``/``global_gather`` and the MoE routing kernels on CPU:
    ``"auto"`` on a build with no accelerator, ``"on"`` on any build (each replacement still
    hands non-gloo groups and device tensors to Paddle), ``"off"`` never
    (``PADDLE_HYBRID_EXPERT_PARALLEL``)."""

    fleet_fixes: bool = True
    """Fix fleet defects that give wrong numbers on any device (:mod:`paddle_hybrid.dygraph.fleet_fixes`:
    global-norm clipping with weights shared between pipeline stages; no data-parallel gradient
    sync for a one-stage ``PipelineLayer``) (``PADDLE_HYBRID_FLEET_FIXES``)."""

    paddleformers_fixes: bool = True
    """Fix PaddleFormers defects that stop its Trainer on any device, once PaddleFormers is
    imported (:mod:`paddle_hybrid.dygraph.paddleformers_fixes`) (``PADDLE_HYBRID_PADDLEFORMERS_FIXES``)."""

    grad_buckets: bool | None = None
    """Let the fleet strategy's ``fuse_all_reduce_ops`` turn on the plugin's fused gradient
    buckets in dygraph DP and hybrid parallel (:mod:`paddle_hybrid.dygraph.grad_buckets`); False keeps
    Paddle's own gradient sync (``PADDLE_HYBRID_GRAD_BUCKETS``).  Tri-state, as
    ``pipeline_send_wait``."""

    grad_bucket_max_params: int = 0
    """Most parameters per gradient bucket, besides ``fuse_grad_size_in_MB``; 0 means no
    count limit (``PADDLE_HYBRID_GRAD_BUCKET_MAX_PARAMS``)."""

    static_fuse_allreduce: bool | None = None
    """Let fleet apply the plugin's static fused all_reduce meta optimizer
    (:mod:`paddle_hybrid.static.fused_allreduce`) (``PADDLE_HYBRID_STATIC_FUSE_ALLREDUCE``).  Tri-state,
    as ``pipeline_send_wait``."""

    static_layout_check_timeout: float | None = None
    """Seconds the cross-rank gradient-layout check of a static data-parallel program waits for
    the other ranks before raising; None: :attr:`timeout`
    (``PADDLE_HYBRID_STATIC_LAYOUT_CHECK_TIMEOUT``)."""

    static_pipeline: str = "auto"
    """Run fleet's legacy static pipeline (``strategy.pipeline``) with micro-batches in ``exe.run``
    (:mod:`paddle_hybrid.static.static_pipeline`): ``"auto"`` on a build with no accelerator (CPU over
    gloo), ``"on"`` also on an accelerator build (never run there), ``"off"`` never
    (``PADDLE_HYBRID_STATIC_PIPELINE``)."""

    static_pipeline_timeout: float | None = None
    """Seconds a rank waits for the others when the static paths' gloo rings and groups are created
    or a pipeline message is awaited; None: :attr:`timeout` (``PADDLE_HYBRID_STATIC_PIPELINE_TIMEOUT``)."""

    auto_parallel_cpu: str = "auto"
    """Let legacy auto-parallel ``Engine.fit`` run on CPU over gloo
    (:mod:`paddle_hybrid.static.auto_parallel_cpu`): ``"auto"`` on a build with no accelerator, ``"on"``,
    ``"off"`` (``PADDLE_HYBRID_AUTO_PARALLEL_CPU``)."""

    pipeline_cudagraph: bool | None = None
    """``PipelineLayer(use_cudagraph=True)`` builds the plugin's ``CUDAGraphedLayer`` (every
    parameter trained, one shared memory pool per model) instead of Paddle's
    (:mod:`paddle_hybrid.dygraph.cuda_graph.pipeline`) (``PADDLE_HYBRID_PIPELINE_CUDAGRAPH``).  Tri-state,
    as ``pipeline_send_wait``; it also decides whether ``CUDAGraphedLayer(backend="auto")`` may
    pick the CUDA backend."""

    allow_unrun: bool = False
    """Opt in to every path of the device rule at once: on a CUDA, XPU or custom-device build,
    the tri-state fields left at None act as True (``PADDLE_HYBRID_ALLOW_UNRUN``).  Those paths
    were written against Paddle's documented API and executed only on CPU."""

    cuda_graph_warmup_steps: int = 3
    """Eager warmup runs before a pipeline layer's first graph capture, >= 0
    (``PADDLE_HYBRID_CUDA_GRAPH_WARMUP_STEPS``)."""

    cuda_malloc_async: bool = False
    """Set ``FLAGS_use_cuda_malloc_async_allocator`` at ``import paddle_hybrid``; Paddle reads it
    once, when the GPU allocator is built, so import the plugin before creating GPU tensors
    (``PADDLE_HYBRID_CUDA_MALLOC_ASYNC``)."""

    cpu_blas_vendor_fix: bool = True
    """On an AMD CPU whose Paddle bundles an MKL that honours it (up to 2020.0), set
    ``MKL_DEBUG_CPU_TYPE=5`` at import so SGEMM takes MKL's AVX2 path instead of its generic one
    (:mod:`paddle_hybrid.cpu_blas`); also exported to the workers of ``python -m
    paddle_hybrid.launch`` (``PADDLE_HYBRID_CPU_BLAS``)."""

    timeline: bool = False
    """Record a per-rank timeline of every pipeline ``train_batch`` (:mod:`paddle_hybrid.dygraph.timeline`;
    :func:`paddle_hybrid.dygraph.timeline.finish` writes it) (``PADDLE_HYBRID_TIMELINE``)."""

    timeout: float = DEFAULT_TIMEOUT
    """The deadline, in seconds in [1, 86400], of every wait the plugin adds for the other ranks:
    the start-up agreement, the layout checks, the static pipeline's rings (unless their own
    fields say otherwise).  A message of a wait that ran out names this setting and the ranks
    waited for (``PADDLE_HYBRID_TIMEOUT``)."""

    startup_agreement: bool = True
    """At ``fleet.distributed_model``, every rank compares the plugin's configuration, the hybrid
    degrees and the pipeline schedule with the others' and a mismatch stops every rank naming the
    field and each rank's value (:mod:`paddle_hybrid.dygraph.agreement`)
    (``PADDLE_HYBRID_STARTUP_AGREEMENT``)."""

    store_nodelay: bool = True
    """On CPU, the job's TCP store sends each request and reply at once (``TCP_NODELAY``) instead
    of waiting about 40 ms for the peer's acknowledgement of the previous piece: every store
    request goes from about 44 ms to well under 1 ms (:mod:`paddle_hybrid.dygraph.cpu.tcp_store`)
    (``PADDLE_HYBRID_STORE_NODELAY``)."""

    force_unverified: tuple = ()
    """Components to install even on a Paddle version they were not verified on: short names as
    ``paddle_hybrid.report()`` prints them (``"cpu"``, ``"cuda_graph.pipeline"``), or ``"all"``
    (``PADDLE_HYBRID_FORCE``, comma-separated)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise TypeError(f"PluginConfig.{f.name} must be a bool, got {value!r}.")
            if f.type == "bool | None" and value is not None and not isinstance(value, bool):
                raise TypeError(f"PluginConfig.{f.name} must be None (the device rule decides), True or "
                                f"False, got {value!r}.")
        if not isinstance(self.force_unverified, tuple) or not all(isinstance(n, str) for n in self.force_unverified):
            raise TypeError("PluginConfig.force_unverified must be a tuple of component names, got "
                            f"{self.force_unverified!r} (PADDLE_HYBRID_FORCE).")
        for name in AUTO_ON_OFF:
            value = getattr(self, name)
            if value not in ("auto", "on", "off"):
                raise ValueError(f"PluginConfig.{name} must be 'auto', 'on' or 'off', got {value!r} "
                                 f"(environment variable {ENVIRONMENT[name]}).")
        for name in ("timeout", "static_pipeline_timeout", "static_layout_check_timeout"):
            if getattr(self, name) is not None or name == "timeout":
                _check_seconds(name, getattr(self, name), ENVIRONMENT[name])
        if (not isinstance(self.grad_bucket_max_params, int) or isinstance(self.grad_bucket_max_params, bool)
                or self.grad_bucket_max_params < 0):
            raise ValueError("PluginConfig.grad_bucket_max_params must be an int >= 0 (0: no limit), got "
                             f"{self.grad_bucket_max_params!r} (PADDLE_HYBRID_GRAD_BUCKET_MAX_PARAMS).")
        if (not isinstance(self.cuda_graph_warmup_steps, int) or isinstance(self.cuda_graph_warmup_steps, bool)
                or self.cuda_graph_warmup_steps < 0):
            raise ValueError("PluginConfig.cuda_graph_warmup_steps must be an int >= 0, got "
                             f"{self.cuda_graph_warmup_steps!r} (PADDLE_HYBRID_CUDA_GRAPH_WARMUP_STEPS).")

    def seconds(self, field: str = "timeout") -> float:
        """The deadline of a path: its own field if set, else :attr:`timeout`."""
        value = getattr(self, field)
        return self.timeout if value is None else value

    def deadline_setting(self, field: str = "timeout") -> str:
        """The environment variable that set the deadline of a path, for messages."""
        return ENVIRONMENT[field if getattr(self, field) is not None else "timeout"]

    @classmethod
    def from_env(cls) -> "PluginConfig":
        readers = {bool: _env_bool, "tristate": lambda name, _default: _env_tristate(name), int: _env_int,
                   float: _env_float, "auto_on_off": _env_auto_on_off,
                   "optional_float": lambda name, _default: _env_float(name, None)}
        values = {}
        for field in dataclasses.fields(cls):
            if field.name == "force_unverified":
                continue
            values[field.name] = readers[_KIND[field.type]](ENVIRONMENT[field.name], field.default)
        values["force_unverified"] = tuple(n.strip() for n in os.environ.get(ENVIRONMENT["force_unverified"], "")
                                           .split(",") if n.strip())
        return cls(**values)
