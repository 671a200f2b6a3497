"""Configuration of the plugin: every knob in one validated dataclass, each declared once.

A field is declared by :func:`setting`: its default, its **kind** (how the environment spells it
and how :func:`paddle_hybrid.registry.gate.decide` reads it), its environment variable (by default
``PADDLE_HYBRID_<NAME>``), and the docstring under it.  Everything else is derived from those
declarations: :data:`ENVIRONMENT`, the gated paths of the device rule, the readers of
:meth:`PluginConfig.from_env`, the checks of ``__post_init__``.

Environment variables are read here and nowhere else (:meth:`PluginConfig.from_env`).  A
component's switch has the component's name (``cpu``: field ``cpu``, ``PADDLE_HYBRID_CPU``); the
names used before that rule (:data:`RENAMED`) keep working, as keyword, attribute and environment
variable, with a ``DeprecationWarning`` naming the new one.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import warnings

__all__ = ["PluginConfig", "setting", "ENVIRONMENT", "KINDS", "RENAMED", "DEFAULT_TIMEOUT", "TIMEOUT_RANGE"]

DEFAULT_TIMEOUT = 600.0
"""Seconds every wait of the plugin allows by default: a rank may pause for a checkpoint save, an
evaluation or a loaded machine for minutes and the job goes on; a rank that hung is named after
ten minutes (Paddle's own silent wait for a missing group is 15)."""

# Deadlines the user sets: at least a second (the stores and rings count whole seconds, so less
# would become 0: no deadline at all) and at most a day (inf or 1e30 overflow the C++ side).
TIMEOUT_RANGE = (1.0, 86400.0)

KINDS = {
    "switch": "on unless False (environment: 1 or 0)",
    "auto_on_off": "'auto', 'on' or 'off': code run on CPU over gloo; 'auto' is on where no accelerator is",
    "unrun": "None, True or False: a path executed only on CPU; None is on where it has run",
    "opt_in": "False unless set: a path never run on any device",
    "count": "an int >= 0",
    "seconds": "seconds in TIMEOUT_RANGE",
    "optional_seconds": "None (the general timeout) or seconds in TIMEOUT_RANGE",
    "names": "a tuple of names (environment: comma-separated)",
    "path": "None or a directory (a str)",
}
"""Every kind of field, and what it takes.  ``auto_on_off``, ``unrun`` and ``opt_in`` are the gated
paths of the device rule (:mod:`paddle_hybrid.registry.gate`)."""


def setting(default, kind: str, env: str | None = None):
    """Declare a field of :class:`PluginConfig`: its default, its kind (one of :data:`KINDS`) and
    its environment variable (``PADDLE_HYBRID_<FIELD NAME>`` when not given)."""
    if kind not in KINDS:
        raise ValueError(f"paddle_hybrid.config: unknown kind {kind!r}; kinds are {sorted(KINDS)}.")
    return dataclasses.field(default=default, metadata={"kind": kind, "env": env})


@dataclasses.dataclass(frozen=True)
class PluginConfig:
    """What ``import paddle_hybrid`` installs.

    Each field can be set from its environment variable (:data:`ENVIRONMENT`, named in its doc).
    """

    cpu_blas: bool = setting(True, "switch")
    """On an AMD CPU whose Paddle bundles an MKL that honours it (up to 2020.0), set
    ``MKL_DEBUG_CPU_TYPE=5`` at import so SGEMM takes MKL's AVX2 path instead of its generic one
    (:mod:`paddle_hybrid.cpu_blas`); also exported to the workers of ``python -m
    paddle_hybrid.launch`` (``PADDLE_HYBRID_CPU_BLAS``)."""

    reshard: bool = setting(True, "switch")
    """Legacy auto-parallel ``Resharder.reshard`` edits programs without a ``_sync_with_cpp``
    per inserted op (:mod:`paddle_hybrid.static.reshard`) (``PADDLE_HYBRID_RESHARD``)."""

    send_wait: bool | None = setting(None, "unrun")
    """With fleet ``strategy.pipeline`` (static), replace the waits for forward sends by a ``ph_nop``
    after the matching backward recv (:mod:`paddle_hybrid.static.send_wait`: its meta optimizer and
    pass are made known to fleet and Paddle) (``PADDLE_HYBRID_SEND_WAIT``).  Tri-state
    (:mod:`paddle_hybrid.registry.gate`): None is on only on a build without an accelerator, True
    opts in everywhere, False is off."""

    fused_allreduce: bool | None = setting(None, "unrun")
    """Let fleet apply the plugin's static fused all_reduce meta optimizer
    (:mod:`paddle_hybrid.static.fused_allreduce`: its meta optimizer and pass are made known to fleet
    and Paddle) (``PADDLE_HYBRID_FUSED_ALLREDUCE``).  Tri-state, as ``send_wait``."""

    static_layout_check_timeout: float | None = setting(None, "optional_seconds")
    """Seconds the cross-rank gradient-layout check of a static data-parallel program waits for
    the other ranks before raising; None: :attr:`timeout`
    (``PADDLE_HYBRID_STATIC_LAYOUT_CHECK_TIMEOUT``)."""

    cpu: str = setting("auto", "auto_on_off")
    """Patch fleet so dygraph hybrid parallel runs on CPU over gloo (:mod:`paddle_hybrid.dygraph.cpu`,
    with the backend :mod:`paddle_hybrid.gloo`): ``"auto"`` on a build with no accelerator (neither
    CUDA nor XPU nor a custom device), ``"on"`` always, ``"off"`` never (``PADDLE_HYBRID_CPU``)."""

    expert_parallel: str = setting("auto", "auto_on_off")
    """Expert parallelism on CPU over gloo (:mod:`paddle_hybrid.dygraph.expert_parallel`): the gloo
    all-to-all family, ``global_scatter``/``global_gather`` and the MoE routing kernels on CPU:
    ``"auto"`` on a build with no accelerator, ``"on"`` on any build (each replacement still
    hands non-gloo groups and device tensors to Paddle), ``"off"`` never
    (``PADDLE_HYBRID_EXPERT_PARALLEL``)."""

    fleet_fixes: bool = setting(True, "switch")
    """Fix fleet defects that give wrong numbers on any device (:mod:`paddle_hybrid.dygraph.fleet_fixes`:
    global-norm clipping with weights shared between pipeline stages; no data-parallel gradient
    sync for a one-stage ``PipelineLayer``) (``PADDLE_HYBRID_FLEET_FIXES``)."""

    paddleformers_fixes: bool = setting(True, "switch")
    """Fix PaddleFormers defects that stop its Trainer on any device, once PaddleFormers is
    imported (:mod:`paddle_hybrid.dygraph.paddleformers_fixes`) (``PADDLE_HYBRID_PADDLEFORMERS_FIXES``)."""

    static_pipeline: str = setting("auto", "auto_on_off")
    """Run fleet's legacy static pipeline (``strategy.pipeline``) with micro-batches in ``exe.run``
    (:mod:`paddle_hybrid.static.static_pipeline`): ``"auto"`` on a build with no accelerator (CPU over
    gloo), ``"on"`` also on an accelerator build (never run there), ``"off"`` never
    (``PADDLE_HYBRID_STATIC_PIPELINE``)."""

    static_pipeline_timeout: float | None = setting(None, "optional_seconds")
    """Seconds a rank waits for the others when the static paths' gloo rings and groups are created
    or a pipeline message is awaited; None: :attr:`timeout` (``PADDLE_HYBRID_STATIC_PIPELINE_TIMEOUT``)."""

    auto_parallel_cpu: str = setting("auto", "auto_on_off")
    """Let legacy auto-parallel ``Engine.fit`` run on CPU over gloo
    (:mod:`paddle_hybrid.static.auto_parallel_cpu`): ``"auto"`` on a build with no accelerator, ``"on"``,
    ``"off"`` (``PADDLE_HYBRID_AUTO_PARALLEL_CPU``)."""

    grad_buckets: bool | None = setting(None, "unrun")
    """Let the fleet strategy's ``fuse_all_reduce_ops`` turn on the plugin's fused gradient
    buckets in dygraph DP and hybrid parallel (:mod:`paddle_hybrid.dygraph.grad_buckets`); False keeps
    Paddle's own gradient sync (``PADDLE_HYBRID_GRAD_BUCKETS``).  Tri-state, as ``send_wait``."""

    sharding_fused_comm: str = setting("auto", "auto_on_off")
    """Sharding stage 1 (fleet's ``DygraphShardingOptimizer``) on a gloo group sends the gradients
    and the updated parameters with one collective per owning rank instead of one per parameter
    (:mod:`paddle_hybrid.dygraph.sharding_fused_comm`): ``"auto"`` on a build with no accelerator,
    ``"on"``, ``"off"``; a group of another backend keeps Paddle's calls in any case
    (``PADDLE_HYBRID_SHARDING_FUSED_COMM``)."""

    local_ring: bool = setting(True, "switch")
    """On a one-node job, ``all_reduce``, ``broadcast`` and ``all_gather`` of a gloo group go through
    shared memory instead of gloo's TCP pairs (:mod:`paddle_hybrid.gloo.local_ring`; part of the
    ``cpu`` component) (``PADDLE_HYBRID_LOCAL_RING``)."""

    local_p2p: bool = setting(True, "switch")
    """On a one-node job, ``send`` and ``recv`` (``isend``/``irecv``, pipeline p2p) of a gloo group go
    through shared memory, buffered, instead of gloo's rendezvous over TCP
    (:mod:`paddle_hybrid.gloo.local_p2p`; part of the ``cpu`` component) (``PADDLE_HYBRID_LOCAL_P2P``)."""

    warm_start: bool = setting(True, "switch")
    """``python -m paddle_hybrid.launch`` starts one process per local worker at its first line, which
    imports Paddle while the launcher imports its own, and hands each worker's command to one
    (:mod:`paddle_hybrid.launch.warm_start`, which says when it does not) (``PADDLE_HYBRID_WARM_START``)."""

    pipeline_fused_p2p: bool = setting(True, "switch")
    """On gloo, a pipeline stage's tuple of tensors travels to the next stage (and its gradients
    back) as one message of their bytes instead of one message a tensor
    (:mod:`paddle_hybrid.dygraph.cpu.p2p`, part 3) (``PADDLE_HYBRID_PIPELINE_FUSED_P2P``)."""

    grad_bucket_max_params: int = setting(0, "count")
    """Most parameters per gradient bucket, besides ``fuse_grad_size_in_MB``; 0 means no
    count limit (``PADDLE_HYBRID_GRAD_BUCKET_MAX_PARAMS``)."""

    agreement: bool = setting(True, "switch")
    """At ``fleet.distributed_model``, every rank compares the plugin's configuration, the hybrid
    degrees and the pipeline schedule with the others' and a mismatch stops every rank naming the
    field and each rank's value (:mod:`paddle_hybrid.dygraph.agreement`) (``PADDLE_HYBRID_AGREEMENT``)."""

    cuda_graph: bool | None = setting(None, "unrun")
    """``PipelineLayer(use_cudagraph=True)`` builds the plugin's ``CUDAGraphedLayer`` (every
    parameter trained, one shared memory pool per model) instead of Paddle's
    (:mod:`paddle_hybrid.dygraph.cuda_graph`) (``PADDLE_HYBRID_CUDA_GRAPH``).  Tri-state, as
    ``send_wait``; it also decides whether ``CUDAGraphedLayer(backend="auto")`` may pick the CUDA
    backend."""

    cuda_graph_warmup_steps: int = setting(3, "count")
    """Eager warmup runs before a pipeline layer's first graph capture, >= 0
    (``PADDLE_HYBRID_CUDA_GRAPH_WARMUP_STEPS``)."""

    cuda_malloc_async: bool = setting(False, "opt_in")
    """Set ``FLAGS_use_cuda_malloc_async_allocator`` at ``import paddle_hybrid``; Paddle reads it
    once, when the GPU allocator is built, so import the plugin before creating GPU tensors
    (``PADDLE_HYBRID_CUDA_MALLOC_ASYNC``)."""

    timeline: bool = setting(False, "switch")
    """Record a per-rank timeline of every pipeline ``train_batch`` (:mod:`paddle_hybrid.dygraph.timeline`;
    :func:`paddle_hybrid.dygraph.timeline.finish` writes it) (``PADDLE_HYBRID_TIMELINE``)."""

    allow_unrun: bool = setting(False, "switch")
    """Opt in to every ``auto_on_off`` and ``unrun`` path of the device rule at once: on a CUDA, XPU
    or custom-device build, those left at their default (``"auto"``, None) act as on
    (``PADDLE_HYBRID_ALLOW_UNRUN``); an explicit off wins.  Those paths were written against
    Paddle's documented API and executed only on CPU; ``opt_in`` fields are not set by it."""

    timeout: float = setting(DEFAULT_TIMEOUT, "seconds")
    """The deadline, in seconds in [1, 86400], of every wait the plugin adds for the other ranks:
    the start-up agreement, the layout checks, the gloo groups, the static pipeline's rings (unless
    their own fields say otherwise).  A message of a wait that ran out names this setting and the
    ranks waited for (``PADDLE_HYBRID_TIMEOUT``)."""

    store_nodelay: bool = setting(True, "switch")
    """On CPU, the job's TCP store sends each request and reply at once (``TCP_NODELAY``) instead
    of waiting about 40 ms for the peer's acknowledgement of the previous piece: every store
    request goes from about 44 ms to well under 1 ms (:mod:`paddle_hybrid.gloo.tcp_store`)
    (``PADDLE_HYBRID_STORE_NODELAY``)."""

    check_replicas: int = setting(0, "count")
    """Every this many optimizer steps of a fleet (hybrid parallel) run, compare a digest of every
    parameter that should be the same on several ranks: within each tensor-parallel, data-parallel
    and sharding group, and a weight tied across pipeline stages; stop with the parameter, the
    group and the ranks that differ (:mod:`paddle_hybrid.dygraph.replica_check`); 0 is off
    (``PADDLE_HYBRID_CHECK_REPLICAS``)."""

    verify_dir: str | None = setting(None, "path")
    """Set by ``python -m paddle_hybrid.verify`` for the runs it makes: the directory a run records
    its losses and parameters in, and reads its plan from (:mod:`paddle_hybrid.dygraph.verify_record`)
    (``PADDLE_HYBRID_VERIFY_DIR``)."""

    fake_world: str | None = setting(None, "path")
    """Set by ``python -m paddle_hybrid.dryrun`` for the rank it runs: a world file naming this
    process's rank of a job with no peer (:mod:`paddle_hybrid.gloo.fake_world`); the shared-memory
    paths (``local_ring``, ``local_p2p``) stay off in such a world (``PADDLE_HYBRID_FAKE_WORLD``)."""

    dryrun_probe: str | None = setting(None, "path")
    """Set by ``python -m paddle_hybrid.dryrun`` for the runs it makes (and by its tests for a real run
    to compare with): the directory this rank writes what it holds and moves into
    (:mod:`paddle_hybrid.dygraph.dryrun_probe`) (``PADDLE_HYBRID_DRYRUN_PROBE``)."""

    balanced_routing: bool = setting(False, "switch")
    """Set by ``python -m paddle_hybrid.dryrun`` for every rank it runs (and by its tests for a real run
    to compare with): the MoE gates route tokens round-robin, every expert the same count within one,
    so a step has the memory and communication of a balanced one
    (:mod:`paddle_hybrid.dygraph.balanced_routing`) (``PADDLE_HYBRID_BALANCED_ROUTING``)."""

    force_unverified: tuple = setting((), "names", env="PADDLE_HYBRID_FORCE")
    """Components to install even on a Paddle version they were not verified on: names as
    ``paddle_hybrid.report()`` prints them (``"cpu"``, ``"cuda_graph"``), or ``"all"``
    (``PADDLE_HYBRID_FORCE``, comma-separated)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check(f.name, kind_of(f.name), getattr(self, f.name))

    def seconds(self, field: str = "timeout") -> float:
        """The deadline of a path: its own field if set, else :attr:`timeout`."""
        value = getattr(self, field)
        return self.timeout if value is None else value

    def deadline_setting(self, field: str = "timeout") -> str:
        """The environment variable that set the deadline of a path, for messages."""
        return ENVIRONMENT[field if getattr(self, field) is not None else "timeout"]

    def __getattr__(self, name):  # only for names that are not fields: the renamed ones
        if name in RENAMED:
            new = RENAMED[name][0]
            _warn_renamed(f"PluginConfig.{name}", f"PluginConfig.{new}")
            return getattr(self, new)
        raise AttributeError(f"'PluginConfig' object has no attribute {name!r}")

    @classmethod
    def from_env(cls) -> "PluginConfig":
        """Every field from its environment variable (unset or empty: the default); a renamed
        variable still set is read with a DeprecationWarning."""
        values = {}
        for f in dataclasses.fields(cls):
            raw, name = _raw_env(f.name)
            if raw is not None and raw.strip() != "":
                values[f.name] = _READERS[kind_of(f.name)](name, raw)
        values.update(_deprecated_env_switches(values))
        return cls(**values)


# -- what the declarations give ----------------------------------------------------------------

ENVIRONMENT = {f.name: f.metadata["env"] or "PADDLE_HYBRID_" + f.name.upper() for f in dataclasses.fields(PluginConfig)}
"""The environment variable of every field (:meth:`PluginConfig.from_env` reads them; messages name them)."""


def kind_of(field: str) -> str:
    """The kind of a field (one of :data:`KINDS`)."""
    return PluginConfig.__dataclass_fields__[field].metadata["kind"]


def fields_of_kind(*kinds: str) -> list:
    """Names of the fields of these kinds, in declaration order."""
    return [f.name for f in dataclasses.fields(PluginConfig) if f.metadata["kind"] in kinds]


# -- names used before the switches took their components' names ---------------------------------

RENAMED = {  # old field: (new field, old environment variable)
    "cpu_hybrid": ("cpu", "PADDLE_HYBRID_CPU_HYBRID"),
    "pipeline_cudagraph": ("cuda_graph", "PADDLE_HYBRID_PIPELINE_CUDAGRAPH"),
    "startup_agreement": ("agreement", "PADDLE_HYBRID_STARTUP_AGREEMENT"),
    "static_fuse_allreduce": ("fused_allreduce", "PADDLE_HYBRID_STATIC_FUSE_ALLREDUCE"),
    "pipeline_send_wait": ("send_wait", "PADDLE_HYBRID_PIPELINE_SEND_WAIT"),
    "reshard_deferred_sync": ("reshard", "PADDLE_HYBRID_RESHARD_DEFERRED_SYNC"),
    "cpu_blas_vendor_fix": ("cpu_blas", None),  # its variable, PADDLE_HYBRID_CPU_BLAS, did not change
}

# ``register_meta_optimizers`` (PADDLE_HYBRID_META_OPTIMIZERS) switched the component that made both
# static meta optimizers known to fleet; each is its feature's own component now.
META_OPTIMIZERS_FIELD, META_OPTIMIZERS_ENV = "register_meta_optimizers", "PADDLE_HYBRID_META_OPTIMIZERS"
META_OPTIMIZER_SWITCHES = ("fused_allreduce", "send_wait")


def _warn_renamed(old: str, new: str) -> None:
    warnings.warn(f"paddle_hybrid: {old} is deprecated; use {new}.", DeprecationWarning, stacklevel=3)


def _renamed_keywords(kwargs: dict) -> dict:
    """``PluginConfig(cpu_hybrid=...)`` as ``PluginConfig(cpu=...)``, with a warning."""
    out = dict(kwargs)
    for old, (new, _env) in RENAMED.items():
        if old in out:
            _warn_renamed(f"PluginConfig({old}=...)", f"PluginConfig({new}=...)")
            value = out.pop(old)
            if new in out and out[new] != value:
                raise ValueError(f"PluginConfig: {old} (deprecated) and {new} are both given, with different values.")
            out[new] = value
    if META_OPTIMIZERS_FIELD in out:
        wanted = out.pop(META_OPTIMIZERS_FIELD)
        names = " and ".join(f"PluginConfig({n}=False)" for n in META_OPTIMIZER_SWITCHES)
        _warn_renamed(f"PluginConfig({META_OPTIMIZERS_FIELD}=...)", names + " to turn them off")
        if wanted is False:
            for name in META_OPTIMIZER_SWITCHES:
                out[name] = False
    return out


def _with_renamed_keywords(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **_renamed_keywords(kwargs))

    return __init__


PluginConfig.__init__ = _with_renamed_keywords(PluginConfig.__init__)


def _raw_env(field: str):
    """``(value, variable name)`` of a field's environment variable; a renamed variable that is
    set answers (with a warning) when the new one is not."""
    name = ENVIRONMENT[field]
    raw = os.environ.get(name)
    old_env = next((env for old, (new, env) in RENAMED.items() if new == field and env), None)
    if old_env is not None and os.environ.get(old_env, "").strip() != "":
        if raw is not None and raw.strip() != "":
            if raw.strip() != os.environ[old_env].strip():
                raise ValueError(f"paddle_hybrid: {old_env} (deprecated) and {name} are both set, to different "
                                 f"values; keep {name}.")
        else:
            _warn_renamed(f"environment variable {old_env}", name)
            return os.environ[old_env], old_env
    return raw, name


def _deprecated_env_switches(values: dict) -> dict:
    """PADDLE_HYBRID_META_OPTIMIZERS=0 turns both static meta optimizers off, with a warning."""
    raw = os.environ.get(META_OPTIMIZERS_ENV, "").strip()
    if raw == "":
        return {}
    names = " and ".join(f"{ENVIRONMENT[n]}=0" for n in META_OPTIMIZER_SWITCHES)
    _warn_renamed(f"environment variable {META_OPTIMIZERS_ENV}", names)
    if _read_bool(META_OPTIMIZERS_ENV, raw):
        return {}
    return {name: False for name in META_OPTIMIZER_SWITCHES if values.get(name) is not True}


# -- reading and checking values, by kind ------------------------------------------------------------

def _read_bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"paddle_hybrid: environment variable {name}={raw!r} is not a boolean; use 1 or 0.")


def _read_int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"paddle_hybrid: environment variable {name}={raw!r} is not an integer.") from None


def _read_float(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"paddle_hybrid: environment variable {name}={raw!r} is not a number.") from None


_READERS = {
    "switch": _read_bool, "unrun": _read_bool, "opt_in": _read_bool,
    "auto_on_off": lambda name, raw: raw.strip().lower(),
    "count": _read_int, "seconds": _read_float, "optional_seconds": _read_float,
    "names": lambda name, raw: tuple(n.strip() for n in raw.split(",") if n.strip()),
    "path": lambda name, raw: raw.strip(),
}


def _check(field: str, kind: str, value) -> None:
    """Reject a value the field's kind does not take, naming the field and its variable."""
    where = f"(environment variable {ENVIRONMENT[field]})"
    if kind in ("switch", "opt_in") and not isinstance(value, bool):
        raise TypeError(f"PluginConfig.{field} must be a bool, got {value!r} {where}.")
    if kind == "unrun" and value is not None and not isinstance(value, bool):
        raise TypeError(f"PluginConfig.{field} must be None (the device rule decides), True or False, got "
                        f"{value!r} {where}.")
    if kind == "auto_on_off" and value not in ("auto", "on", "off"):
        raise ValueError(f"PluginConfig.{field} must be 'auto', 'on' or 'off', got {value!r} {where}.")
    if kind == "count" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"PluginConfig.{field} must be an int >= 0, got {value!r} {where}.")
    if kind == "seconds" or (kind == "optional_seconds" and value is not None):
        low, high = TIMEOUT_RANGE
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ValueError(f"PluginConfig.{field} must be a number of seconds in [{low:g}, {high:g}], got "
                             f"{value!r} {where}.")
    if kind == "path" and value is not None and (not isinstance(value, str) or not value):
        raise TypeError(f"PluginConfig.{field} must be None or a directory path, got {value!r} {where}.")
    if kind == "names" and (not isinstance(value, tuple) or not all(isinstance(n, str) for n in value)):
        raise TypeError(f"PluginConfig.{field} must be a tuple of component names, got {value!r} {where}.")
