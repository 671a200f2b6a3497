"""What one rank holds and moves, measured in its own process: the record of ``python -m
paddle_hybrid.dryrun`` (component ``dryrun_probe``, on when ``PluginConfig.dryrun_probe`` names a
directory: ``PADDLE_HYBRID_DRYRUN_PROBE``).  The same probe runs in a dry run's fake world and in a
real multi-process run, so the two are compared figure for figure.

Measured (Paddle's host allocator counts every byte it hands out; a tensor's bytes are its
elements times its element size):

- **parameters**: every parameter alive in the process at the first optimizer update (a
  DistTensor by its local value), bytes by dtype;
- **gradients**: at the first update, each parameter's gradient (``main_grad`` where fleet keeps
  one, else ``grad``), bytes by dtype;
- **fused FSDP** (Paddle's ``fully_shard`` in auto-parallel mode, PaddleFormers' ``--enable_auto_parallel
  1``): its parameters hold no storage between forwards, so the parameters are this rank's pieces of
  the fused parameter buffers and the gradients its pieces of the fused gradient buffers
  (:func:`_fused_fsdp_buffers`); the groups are recorded (``fused_fsdp``) for the report;
- **optimizer state**: after the first update, every accumulator and master weight of every
  optimizer that updated, bytes by dtype;
- **activations**: bytes of the tensors saved for backward (``saved_tensors_hooks``; a storage
  counted once per microbatch; parameters an op saves, such as a matmul's weight, are not
  activations; a ``PyLayer``'s ``save_for_backward``, which the hooks do not see, is counted too:
  recompute keeps its segment's input so) during the second step, and the step's backward calls
  (its microbatches; the interleaved schedule makes one a chunk of a microbatch); what recompute's
  forward saves again inside backward is counted apart (``recomputed_bytes_per_step``: held only
  while its segment's backward runs); the same bytes by kind and dtype (``activations_by_kind``:
  ``square:float32`` for attention's ``[b, heads, s, s]`` tensors, ``other:<dtype>``), for the GPU
  estimate;
- **peak**: the allocator's peak from the end of the first update to the end of the second (the
  steady state: the optimizer state exists, one step's activations come and go); with one step only,
  from the start of the process (``peak_window`` says which);
- **optimizer steps**: how many updates the rank made (``optimizer_steps``), and whether the second,
  the measured one, completed (``measured_step_completed``): activations, microbatches and the step-2
  peak exist only then, and the dry run refuses a rank's run without it rather than report zeros;
- **sharding partition** (sharding stage 1, fleet's ``DygraphShardingOptimizer``): the optimizer state
  every other sharding rank of this stage holds, by dtype, from the partition this rank's optimizer
  made (which parameters each sharding rank updates) and the state this rank's optimizer keeps per
  parameter; recorded only when that rule gives this rank's own measured state exactly, so the dry
  run can stand one run for every sharding rank of a stage (:func:`_sharding_partition`);
- **routing**: how this rank's MoE gates routed, when any did (:mod:`paddle_hybrid.common.routing_record`:
  ``forced-balanced`` in a dry run, with the tokens the last call sent each expert);
- **checkpoint loads** (a dry run): each flex-checkpoint load the fake world answered without reading
  it (:mod:`paddle_hybrid.gloo.fake_checkpoint`: the directory, this rank's tensors and bytes it
  would have written, the data files on disk, ``weights_read: false``);
- **topology**: fleet's degrees and this rank's coordinates, when the script made a hybrid
  communicate group;
- **communication**: every call on the rank's process groups (operation, the group's global ranks,
  bytes of this rank's tensor, in order): the fake world's own log, or in a real run the gloo
  process group's methods, wrapped, and the plugin's reduce_scatter on gloo (a C++ kernel that calls
  none of them), each call as the one operation the fake world logs for it.

Written at the process's exit to ``<directory>/probe.<rank>.json``.
"""
from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import sys
import time

from ...common import checkpoint_record, routing_record
from . import kernels, static_programs
from ...common.tensor_bytes import nbytes
from ...gloo import fake_contexts, fake_world
from ...registry.component import Component

__all__ = ["COMPONENT", "apply", "LOGGED_METHODS"]

# Methods of a process group whose calls are the communication log, by the operation the log names (the
# fake world answers the same methods and logs the same names; bytes: the call's first tensor argument).
_OP = {"all_reduce": "all_reduce", "all_reduce_on_calc_stream": "all_reduce", "reduce": "reduce",
       "reduce_on_calc_stream": "reduce",
       "broadcast": "broadcast", "broadcast_on_calc_stream": "broadcast", "barrier": "barrier",
       "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
       "all_gather_into_tensor_on_calc_stream": "all_gather", "all_gather_on_calc_stream": "all_gather",
       "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
       "reduce_scatter_tensor_on_calc_stream": "reduce_scatter", "all_to_all": "all_to_all",
       "all_to_all_tensor": "all_to_all", "all_to_all_on_calc_stream": "all_to_all", "all_to_all_single": "all_to_all",
       "alltoall": "all_to_all", "alltoall_single": "all_to_all", "send": "send", "send_on_calc_stream": "send",
       "recv": "recv", "recv_on_calc_stream": "recv", "allreduce": "all_reduce", "all_gather_partial": "all_gather",
       "all_gather_partial_on_calc_stream": "all_gather", "reduce_scatter_on_calc_stream": "reduce_scatter",
       "all_to_all_single_on_calc_stream": "all_to_all", "all_to_all_tensor_on_calc_stream": "all_to_all",
       "gather": "gather", "scatter": "scatter", "scatter_on_calc_stream": "scatter", "scatter_tensor": "scatter",
       "scatter_tensor_on_calc_stream": "scatter", "send_partial": "send", "send_partial_on_calc_stream": "send",
       "recv_partial": "recv", "recv_partial_on_calc_stream": "recv"}
LOGGED_METHODS = tuple(_OP)


def _nbytes(tensor) -> int:
    """This rank's bytes of ``tensor``: a DistTensor's local value, nothing for a freed one."""
    if tensor.is_dist():
        tensor = tensor._local_value()
    return nbytes(tensor) if tensor._is_initialized() else 0


def _by_dtype(tensors) -> dict:
    out = {}
    for tensor in tensors:
        key = str(tensor.dtype).replace("paddle.", "")
        out[key] = out.get(key, 0) + _nbytes(tensor)
    return out


class _Probe:
    def __init__(self, directory: str):
        self.directory = directory
        self.record = {"rank": _rank(), "optimizer_steps": 0, "measured_step_completed": False,
                       "peak_window": "process"}
        self.optimizers = []
        self.saved = {"bytes": 0, "ptrs": set(), "backward_calls": 0, "in_backward": 0, "by_kind": {}}
        self.window_open = False
        self.comm = []
        self.groups = {}  # id(process group) -> its global ranks (a real run)
        self.rings = {}  # the same for a static pipeline's rings (gloo.rings)
        self.inside_logged_call = 0  # a logged collective made of others: only it is logged
        self.kernels = kernels.KernelLog()
        self.kernels.in_backward = lambda: bool(self.saved["in_backward"])

    # -- a static program's step: one Executor.run of a program holding an optimizer op
    def static_step(self, program, scope, microbatches=None) -> None:
        steps = self.record["optimizer_steps"]
        if steps == 0:
            # Python's cyclic garbage of the first step (the loader's tensors, the feed) would otherwise
            # be freed, or not, inside the measured step, when the collector happens to run: one rank's
            # peak over five runs, 1.7-3.6 MiB without this, 1.69-1.73 MiB with it (the executor's own
            # schedule still moves it: docs/dryrun.md)
            gc.collect()
            self.record["program"] = "pir" if static_programs.is_pir(program) else "legacy"
            # while the script's optimizer is alive (dist.shard_optimizer's axis); fleet.init's default
            # hybrid group, which dist.to_static makes, says nothing of the program's layout
            self.record["topology"] = _mesh_topology(self.optimizers) or _each_rank_alone()
            self.record["parameters"] = static_programs.scope_bytes(scope, static_programs.parameter_names(program))
            self.record["gradients"] = static_programs.gradients(static_programs.rank_program(program))
            self.record["optimizer"] = static_programs.scope_bytes(scope, static_programs.state_names(program))
            by_kind, unsized = static_programs.activations(static_programs.rank_program(program),
                                                           static_programs.micro_batch_size(program))
            microbatches = microbatches or static_programs.microbatches(program)
            self.static_activations = ({k: v * microbatches for k, v in by_kind.items()}, unsized, microbatches)
        self._count_update()
        if self.record["optimizer_steps"] == 1:
            self._open_window()
        elif self.record["optimizer_steps"] == 2:
            by_kind, unsized, microbatches = self.static_activations
            self.saved.update(bytes=sum(by_kind.values()), by_kind=by_kind, backward_calls=microbatches)
            self.record["activations_unsized"] = unsized
            self._close_window()

    # -- the first and second optimizer updates
    def before_update(self, optimizer, params_grads) -> None:
        if self.record["optimizer_steps"] == 0:
            # while the model is alive (a script may drop it before the process exits)
            self.record["virtual_stages"] = _virtual_stages()
            fused_params, fused_grads = _fused_fsdp_buffers()
            self.record["parameters"] = _by_dtype(_alive_parameters() + fused_params)
            grads = [g for _, g in params_grads if g is not None]
            self.record["gradients"] = _by_dtype((_gradients() or grads) + fused_grads)
            if fused_params:
                self.record["fused_fsdp"] = _fused_fsdp_record()
        if all(o is not optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)

    def after_update(self) -> None:
        self._count_update()
        if self.record["optimizer_steps"] == 1:
            self.record["optimizer"] = _by_dtype(_optimizer_state(self.optimizers))
            partition = _sharding_partition(self.optimizers, self.record["optimizer"])
            if partition is not None:
                self.record["sharding_partition"] = partition
            self._open_window()
        elif self.record["optimizer_steps"] == 2:
            self._close_window()

    def _count_update(self) -> None:
        self.record["optimizer_steps"] += 1
        self.record.setdefault("update_times", []).append(time.time())
        calls = fake_world.log_length() if fake_world.active() else len(self.comm) + fake_contexts.count()
        self.record.setdefault("comm_marks", []).append(calls)
        if fake_world.active():  # the dry run shows which rank is where
            steps = self.record["optimizer_steps"]
            print(f"[paddle_hybrid.dryrun] rank {self.record['rank']}: optimizer step {steps} done", file=sys.stderr,
                  flush=True)

    def _open_window(self) -> None:
        """After the first update: the measured step begins (peak, saved tensors, kernels)."""
        from paddle.base import core

        core.host_memory_stat_reset_peak_value("Allocated", 0)
        self.saved.update(bytes=0, ptrs=set(), backward_calls=0, by_kind={})
        self.record["recomputed_bytes_per_step"] = 0
        self.window_open = True
        self.kernels.recording = True

    def _close_window(self) -> None:
        """After the second update: the measured step's figures."""
        from paddle.base import core

        self.record["peak_bytes"] = int(core.host_memory_stat_peak_value("Allocated", 0))
        self.record["peak_window"] = "step 2"
        self.record["step_2_seconds"] = self.record["update_times"][1] - self.record["update_times"][0]
        self.record["activations_bytes_per_step"] = self.saved["bytes"]
        self.record["activations_by_kind"] = dict(self.saved["by_kind"])
        self.record["microbatches"] = self.saved["backward_calls"]
        self.record["measured_step_completed"] = True
        self.window_open = False
        self.kernels.recording = False
        self.record["kernels"] = self.kernels.as_json()

    # -- saved for backward
    def pack(self, tensor):
        if tensor.is_dist() and not _holds_local_memory(tensor):
            return _NoLocalValue(tensor)  # an op of another mesh: nothing saved on this rank
        # A parameter saved by its op (a matmul's weight) is counted with the parameters, not as an activation.
        if self.window_open and not tensor.persistable:
            if self.saved["in_backward"]:  # recompute's forward, run again inside backward: held only there
                self.record["recomputed_bytes_per_step"] = self.record.get("recomputed_bytes_per_step", 0) + \
                    _nbytes(tensor)
                return _kept(tensor)
            ptr = tensor.data_ptr() if tensor._is_initialized() else id(tensor)
            if ptr not in self.saved["ptrs"]:
                self.saved["ptrs"].add(ptr)
                size = _nbytes(tensor)
                self.saved["bytes"] += size
                kind = "square" if _square(tensor) else "other"
                key = f"{kind}:{str(tensor.dtype).replace('paddle.', '')}"
                self.saved["by_kind"][key] = self.saved["by_kind"].get(key, 0) + size
        return _kept(tensor)

    def backward_called(self) -> None:
        if self.window_open:
            self.saved["backward_calls"] += 1
            self.saved["ptrs"] = set()  # a storage freed by one backward may be reused by the next forward

    def _real_log(self):
        groups = self.groups
        log = []
        for e in self.comm:
            group = groups.get(e["_pg"])
            if group is None:  # a static pipeline's ring: its own gloo group, made outside paddle.distributed
                group = self.rings.get(e["_pg"])
            entry = {"op": e["op"], "group": group, "bytes": e["bytes"], "seq": e["seq"]}
            if "_peer" in e:
                entry["peer"] = group[e["_peer"]] if group is not None else e["_peer"]
            log.append(entry)
        return log

    def write(self) -> None:
        from paddle.base import core

        # Python hooks left registered hang Paddle's teardown of the autograd graph at exit.
        core.eager.reset_saved_tensors_hooks()

        if "peak_bytes" not in self.record:
            self.record["peak_bytes"] = int(core.host_memory_stat_peak_value("Allocated", 0))
        if "program" not in self.record:  # a static program's was taken at its first step
            self.record["topology"] = _topology() or _mesh_topology(self.optimizers)
        self.record.setdefault("virtual_stages", _virtual_stages())
        # Both merge the C++ collectives' log into the Python one, in call order.
        self.record["communication"] = fake_world.log() if fake_world.active() else fake_contexts.merged(
            self._real_log())
        routing = routing_record.summary()
        if routing is not None:  # MoE gates routed here (forced-balanced in a dry run)
            self.record["routing"] = routing
        loads = checkpoint_record.loads()
        if loads:  # checkpoint loads the fake world answered without reading them (gloo.fake_checkpoint)
            self.record["checkpoint_loads"] = loads
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"probe.{self.record['rank']}.json"), "w") as f:
            json.dump(self.record, f)


def _holds_local_memory(tensor) -> bool:
    """Whether a DistTensor's local value has memory: not on a rank outside the mesh of the op that
    saved it (the semi-auto API runs no kernel there and leaves a 0-byte holder)."""
    local = tensor._local_value()
    return local._is_initialized() and (local._numel() == 0 or local.data_ptr() != 0)


def _kept(tensor):
    """What the pack hook keeps of a saved tensor: the same storage without its autograd history.

    Why not the tensor itself: a grad node keeps what its pack hook returned, and an op's own output
    saved for its backward (softmax, exp, ...) points back at that node through its autograd meta.
    Kept whole, node and tensor hold each other in C++, out of Python's collector, and every step's
    saved activations stay alive: Paddle 3.2-3.3 with an identity pack hook grows by a step's
    activations every step (a tiny LLaMA's stage 0: 0.04 GiB allocated after each update without the
    hook, 0.07, 0.10, 0.14, 0.17 GiB with it), and the probe measured each step's peak over the last
    step's activations.  ``detach()`` shares the storage and drops the history; ``stop_gradient`` is
    the tensor's own (a ``PyLayer`` gets the unpacked tensor itself: fleet's recompute asks its saved
    inputs whether they need a gradient, and ``detach()`` would say no)."""
    kept = tensor.detach()
    kept.stop_gradient = tensor.stop_gradient
    return kept


class _NoLocalValue:
    """What the pack hook keeps for a DistTensor without local memory.

    Why not the tensor itself: Paddle 3.2-3.3's ``TensorWrapper::recover`` puts the unpacked
    tensor's holder into a tensor of the saved shape after checking that the holder is large
    enough, so a 0-byte holder fails every backward of a rank outside an op's mesh (a semi-auto
    pipeline's other stages) once any saved-tensor hook is registered.  The unpacked tensor is
    :func:`paddle_hybrid.ops.unbacked`: a holder of the right size that owns no memory (that op's
    backward runs no kernel on this rank, and the allocator's figures stay as without the probe)."""

    def __init__(self, tensor):
        self.dtype, self.shape = tensor.dtype, list(tensor._local_value().shape)

    def unpack(self):
        from ... import ops

        return ops.unbacked(self.shape, self.dtype)


def _unpack(packed):
    return packed.unpack() if isinstance(packed, _NoLocalValue) else packed


def _square(tensor) -> bool:
    """A tensor of 4 or more dimensions whose last two are equal and over 1: attention's scores,
    probabilities or mask (``[batch, heads, s, s]``), which a GPU's fused attention does not save."""
    shape = list(tensor.shape)
    return len(shape) >= 4 and shape[-1] == shape[-2] > 1


def _rank() -> int:
    return int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def _alive_parameters():
    from paddle.base.framework import EagerParamBase

    seen, params = set(), []
    for obj in gc.get_objects():
        if isinstance(obj, EagerParamBase) and id(obj) not in seen:
            seen.add(id(obj))
            params.append(obj)
    return params


def _gradients():
    grads = []
    for param in _alive_parameters():
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad
        if grad is not None:
            grads.append(grad)
    return grads


def _fused_fsdp_buffers():
    """Paddle's fused FSDP (``fully_shard`` in auto-parallel mode, :mod:`paddle_hybrid.common.fused_fsdp`):
    ``(parameter pieces, gradient pieces)``, the fused buffers this rank holds between steps.  Its
    parameters are freed between forwards (0 bytes here, as :func:`_nbytes` counts them); what the
    rank keeps is each group's piece of the fused parameter buffer (the tensor the optimizer updates)
    and its piece of the fused float32 gradient buffer (what the reduce-scatter leaves it).  The
    whole-group buffers a forward or backward gathers into are transient: in the peak, not here."""
    from ...common import fused_fsdp

    fsdp = fused_fsdp.context()
    if fsdp is None:
        return [], []
    params, grads = [], []
    for group in fsdp.buffer_manager.buffer_groups:
        params.append(group.params_buffer.data_buffer)
        if group.grads_buffer is not None:
            grads.append(group.grads_buffer.data_buffer)
    return params, grads


def _fused_fsdp_record() -> dict:
    """The fused groups, for the report: per group its parameters, its buffers' dtypes and element
    sizes, whole (padded) elements and this rank's pieces, and the FSDP group's global ranks."""
    from ...common import fused_fsdp

    fsdp = fused_fsdp.context()
    groups = []
    for group in fsdp.buffer_manager.buffer_groups:
        buffer = group.params_buffer
        piece = buffer.data_buffer
        grads = group.grads_buffer
        groups.append({"parameters": len(group.params), "dtype": _dtype_name(piece),
                       "element_bytes": nbytes(piece) // max(int(piece._numel()), 1),
                       "elements": int(buffer.total_buffer_size), "piece_elements": int(piece._numel()),
                       "gradient_dtype": _dtype_name(grads.data_buffer) if grads is not None else None,
                       "gradient_element_bytes": nbytes(grads.data_buffer) // max(int(grads.data_buffer._numel()), 1)
                       if grads is not None else 0,
                       "gradient_piece_elements": int(grads.data_buffer._numel()) if grads is not None else 0})
    return {"group": [int(r) for r in fsdp.buffer_manager._fsdp_group.ranks], "buffers": groups}


def _optimizer_state(optimizers):
    seen, state = set(), []
    for optimizer in optimizers:
        tensors = [t for per_param in getattr(optimizer, "_accumulators", {}).values() for t in per_param.values()]
        tensors += list(getattr(optimizer, "_master_weights", {}).values())
        for tensor in tensors:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                state.append(tensor)
    return state


def _dtype_name(tensor) -> str:
    return str(tensor.dtype).replace("paddle.", "")


def _state_rule(optimizers) -> dict | None:
    """What the optimizers keep per parameter, by the parameter's dtype: ``[(state dtype, bytes per
    element of the parameter, fixed bytes)]``, one of the two 0 (Adam's moments follow the parameter's
    shape, its beta powers are one element); None when two parameters of one dtype keep different kinds."""
    rule = {}
    for optimizer in optimizers:
        params = {p.name: p for p in getattr(optimizer, "_parameter_list", None) or [] if hasattr(p, "name")}
        per_param = {}
        for acc in getattr(optimizer, "_accumulators", {}).values():
            for name, tensor in acc.items():
                per_param.setdefault(name, []).append(tensor)
        for name, tensor in getattr(optimizer, "_master_weights", {}).items():
            per_param.setdefault(name, []).append(tensor)
        for name, tensors in per_param.items():
            param = params.get(name)
            if param is None:
                continue
            shaped = [t._numel() == param._numel() for t in tensors]
            kinds = sorted((_dtype_name(t), nbytes(t) // param._numel() if s else 0, 0 if s else nbytes(t))
                           for t, s in zip(tensors, shaped))
            if rule.setdefault(_dtype_name(param), kinds) != kinds:
                return None
    return rule


def _state_bytes(rule: dict, params) -> dict | None:
    out = {}
    for param in params:
        kinds = rule.get(_dtype_name(param))
        if kinds is None:  # no parameter of this dtype here to learn the rule from
            return None
        for dtype, per_element, fixed in kinds:
            out[dtype] = out.get(dtype, 0) + per_element * param._numel() + fixed
    return out


def _sharding_partition(optimizers, measured: dict) -> dict | None:
    """``{"sharding_rank": r, "optimizer_by_rank": {rank: bytes by dtype}}`` for fleet's sharding stage 1
    (see the module docstring), or None (no such optimizer, or the rule does not give this rank's own)."""
    try:
        from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import \
            DygraphShardingOptimizer
    except ImportError:
        return None
    sharding = next((o for o in gc.get_objects() if isinstance(o, DygraphShardingOptimizer)), None)
    if sharding is None:
        return None
    owned = getattr(sharding, "_rank2fused", None) or getattr(sharding, "_rank2params", None) or {}
    rule = _state_rule(optimizers)
    if not owned or rule is None:
        return None
    by_rank = {int(rank): _state_bytes(rule, params) for rank, params in owned.items()}
    mine = int(sharding._sharding_rank)
    if any(v is None for v in by_rank.values()) or {k: v for k, v in by_rank[mine].items() if v} != \
            {k: v for k, v in measured.items() if v}:
        return None
    return {"sharding_rank": mine, "optimizer_by_rank": by_rank}


def _topology():
    try:
        from paddle.distributed import fleet

        hcg = fleet.get_hybrid_communicate_group()
    except Exception:  # no fleet.init in this script
        return None
    if hcg is None or not hasattr(hcg, "topology"):  # none, or a static program's (no topology)
        return None
    topo = hcg.topology()
    names = list(topo.get_hybrid_group_names())
    return {"names": names, "degrees": {n: int(topo.get_dim(n)) for n in names},
            "coordinate": dict(zip(names, (int(c) for c in topo.get_coord(hcg.get_global_rank())))),
            "stage": int(hcg.get_stage_id())}


# The semi-auto API's usual mesh dimension names, as fleet names its axes (classes.KEY_AXES reads these).
_MESH_AXES = {"pp": "pipe", "dp": "data", "mp": "model", "tp": "model", "sep": "sep", "cp": "context"}


def _mesh_topology(optimizers):
    """The semi-auto API's global mesh (``dist.auto_parallel.set_mesh``) as a topology, when its ranks
    are numbered row-major as fleet numbers its axes (otherwise one axis, each rank its own class);
    None without a mesh.  ``key_axes``: the axes whose
    coordinate changes what a rank holds: the pipeline's, one over which optimizer state is sharded
    (``dp_config``'s sharding levels), and any axis of a name not in :data:`_MESH_AXES`."""
    try:
        import paddle.distributed as dist

        mesh = dist.auto_parallel.get_mesh()
    except Exception:  # no mesh set: a script without the semi-auto API
        return None
    if mesh is None:
        return None
    if list(mesh.process_ids) != list(range(len(mesh.process_ids))):  # not fleet's numbering: each rank alone
        size = len(mesh.process_ids)
        return {"names": ["rank"], "degrees": {"rank": size}, "coordinate": {"rank": _rank()}, "stage": 0,
                "key_axes": ["rank"], "mesh_dim_names": list(mesh.dim_names)}
    dims = list(mesh.dim_names)
    sharded = _optimizer_sharded_dims(optimizers, mesh) | _shard_optimizer_dims(mesh)
    names = ["sharding" if i in sharded else _MESH_AXES.get(n, n) for i, n in enumerate(dims)]
    degrees = {n: int(d) for n, d in zip(names, mesh.shape)}
    rank = _rank()
    coordinate = dict(zip(names, _row_major(rank, list(mesh.shape))))
    keys = [n for n in names if n in ("pipe", "sharding") or n not in _MESH_AXES.values()]
    return {"names": names, "degrees": degrees, "coordinate": coordinate, "stage": coordinate.get("pipe", 0),
            "key_axes": keys, "mesh_dim_names": dims}


def _each_rank_alone() -> dict:
    """A topology in which each rank is a class of its own (nothing says which ranks hold alike)."""
    size = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    return {"names": ["rank"], "degrees": {"rank": size}, "coordinate": {"rank": _rank()}, "stage": 0,
            "key_axes": ["rank"]}


def _row_major(rank: int, shape: list) -> list:
    """Row-major coordinate of ``rank`` in a mesh of ``shape``."""
    out = []
    for size in reversed(shape):
        out.append(rank % size)
        rank //= size
    return list(reversed(out))


def _optimizer_sharded_dims(optimizers, mesh) -> set:
    """Mesh dimensions over which some optimizer state is split (Shard) on this rank."""
    dims = set()
    for tensor in _optimizer_state(optimizers):
        if tensor.is_dist() and tensor.process_mesh == mesh:
            dims.update(i for i, p in enumerate(tensor.placements) if p.is_shard())
    return dims


def _shard_optimizer_dims(mesh) -> set:
    """Mesh dimensions ``dist.shard_optimizer`` shards optimizer state over (stage 1, 2 or 3), by the
    dimension's name: a static program's optimizer state is no DistTensor to ask."""
    try:
        from paddle.distributed.auto_parallel.api import _ShardOptimizer
    except ImportError:
        return set()
    dims = set()
    for obj in gc.get_objects():
        if isinstance(obj, _ShardOptimizer):
            shard_fn = getattr(obj, "_shard_fn", None)
            dim = getattr(shard_fn, "_sharding_mesh_dim", None)
            if type(shard_fn).__name__ != "_ShardingStage0" and isinstance(dim, str) and dim in mesh.dim_names:
                dims.add(list(mesh.dim_names).index(dim))
    return dims


def _virtual_stages() -> int:
    """Model chunks per pipeline stage (fleet's ``PipelineLayer``), 1 without a virtual pipeline."""
    try:
        from paddle.distributed.fleet.meta_parallel import PipelineLayer
    except ImportError:
        return 1
    for obj in gc.get_objects():
        if isinstance(obj, PipelineLayer):
            return int(getattr(obj, "_num_virtual_pipeline_stages", 1) or 1)
    return 1


# --------------------------------------------------------------------------- install


def _make_apply_optimize(stock, probe):
    @functools.wraps(stock)
    def _apply_optimize(self, loss, startup_program, params_grads, *args, **kwargs):
        import paddle

        if not paddle.in_dynamic_mode():  # a static program is being built: its steps are Executor runs
            return stock(self, loss, startup_program, params_grads, *args, **kwargs)
        probe.before_update(self, params_grads if isinstance(params_grads, list) else [])
        probe.kernels.update_begins()
        probe.kernels.in_update = True
        try:
            result = stock(self, loss, startup_program, params_grads, *args, **kwargs)
        finally:
            probe.kernels.in_update = False
        probe.after_update()
        return result

    return _apply_optimize


def _make_executor_run(stock, probe):
    @functools.wraps(stock)
    def run(self, program=None, *args, **kwargs):
        result = stock(self, program, *args, **kwargs)
        import paddle

        target = program if program is not None else paddle.static.default_main_program()
        target = getattr(target, "_program", target)  # a CompiledProgram's own
        if static_programs.is_training(target):
            scope = kwargs.get("scope") or paddle.static.global_scope()
            plan = getattr(self, "plan", None)  # a PIR pipeline's or gradient merge's jobs, one per microbatch
            probe.static_step(target, scope, plan.micro_batch_num() if plan is not None else None)
        return result

    return run


def _make_backward(stock, probe):
    @functools.wraps(stock)
    def backward(*args, **kwargs):
        if not probe.saved["in_backward"]:  # recompute calls backward again inside a microbatch's backward
            probe.backward_called()
        probe.saved["in_backward"] += 1
        try:
            return stock(*args, **kwargs)
        finally:
            probe.saved["in_backward"] -= 1
            if not probe.saved["in_backward"]:
                probe.kernels.backward_ended()

    return backward


def _make_recompute(stock, probe):
    """Recompute keeps its segment's tensor inputs in a ``PyLayer`` context, which the saved-tensor
    hooks do not see: they are counted here, as saved for backward."""
    @functools.wraps(stock)
    def recompute(*args, **kwargs):  # recompute(function, *inputs) or recompute_hybrid(ctx, function, *inputs)
        if not probe.saved["in_backward"]:
            for arg in args:
                if hasattr(arg, "_numel"):
                    probe.pack(arg)
        return stock(*args, **kwargs)

    return recompute


def _count_recompute_inputs(patcher, probe) -> None:
    import importlib

    for module_name, name in (("paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers", "recompute_hybrid"),
                              ("paddle.distributed.fleet.recompute.recompute", "recompute"),
                              ("paddle.distributed.fleet.utils", "recompute")):
        module = importlib.import_module(module_name)
        if hasattr(module, name):
            patcher.set(module, name, _make_recompute(getattr(module, name), probe))


def _make_logged(stock, op, probe):
    from ...gloo import rings

    @functools.wraps(stock)
    def method(self, *args, **kwargs):
        if probe.inside_logged_call:
            return stock(self, *args, **kwargs)
        tensor = next((a for a in args if hasattr(a, "_numel")), None)
        entry = {"op": op, "group": None, "bytes": nbytes(tensor) if tensor is not None else 0, "_pg": id(self)}
        if id(self) not in probe.groups and id(self) not in probe.rings:
            ring_ranks = rings.ranks_of_group(self)
            if ring_ranks is not None:
                probe.rings[id(self)] = ring_ranks
        if op in ("send", "recv"):  # the peer's place in the group follows the tensor
            entry["_peer"] = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
        entry["seq"] = fake_contexts.next_seq()
        probe.comm.append(entry)
        with fake_contexts.paused():  # gloo's process group may run it on a comm context: logged once, here
            return stock(self, *args, **kwargs)

    return method


def _make_logged_reduce_scatter(stock, probe):
    """The plugin's reduce_scatter on gloo runs its C++ kernel (or an ``all_reduce`` and a slice), no
    method of the process group: logged here as the one reduce_scatter asked for (bytes: the output,
    as the fake world's), what it calls inside not."""
    @functools.wraps(stock)
    def reduce_scatter_on_gloo(out_tensor, in_tensor, op, group, *args, **kwargs):
        if probe.inside_logged_call:
            return stock(out_tensor, in_tensor, op, group, *args, **kwargs)
        probe.comm.append({"op": "reduce_scatter", "group": None, "bytes": nbytes(out_tensor),
                           "_pg": id(group.process_group), "seq": fake_contexts.next_seq()})
        probe.inside_logged_call += 1
        try:
            with fake_contexts.paused():
                return stock(out_tensor, in_tensor, op, group, *args, **kwargs)
        finally:
            probe.inside_logged_call -= 1

    return reduce_scatter_on_gloo


def apply(config, patcher) -> str:
    import paddle
    from paddle.base import core

    probe = _Probe(config.dryrun_probe)
    optimizer_cls = paddle.optimizer.Optimizer
    patcher.set(optimizer_cls, "_apply_optimize",
                _make_apply_optimize(patcher.require(optimizer_cls, "_apply_optimize", "paddle.optimizer.Optimizer"),
                                     probe))
    patcher.set(paddle.Tensor, "backward", _make_backward(patcher.require(paddle.Tensor, "backward", "paddle.Tensor"),
                                                          probe))
    autograd = paddle.autograd
    patcher.set(autograd, "backward", _make_backward(patcher.require(autograd, "backward", "paddle.autograd"), probe))
    core.eager.register_saved_tensors_hooks(probe.pack, _unpack)
    executor = paddle.static.Executor
    patcher.set(executor, "run", _make_executor_run(patcher.require(executor, "run", "paddle.static.Executor"), probe))
    _count_recompute_inputs(patcher, probe)
    kernels.install(patcher, probe.kernels)
    patcher.on_revert(core.eager.reset_saved_tensors_hooks, "the dry-run probe's saved-tensor hooks")
    if not config.fake_world:
        _log_real_groups(patcher, probe)
    atexit.register(probe.write)
    patcher.on_revert(lambda: atexit.unregister(probe.write), "the dry-run probe's record at exit")
    return f"records this rank's memory and communication into {config.dryrun_probe}"


def _log_real_groups(patcher, probe) -> None:
    """A real run's communication: the gloo process group's methods (called from Python) and the
    plugin's reduce_scatter on gloo, wrapped; what C++ runs on gloo comm contexts (the semi-auto
    API's reshards, static programs), logged in C++ (:mod:`...gloo.fake_contexts`)."""
    from paddle.base import core

    fake_contexts.apply(patcher, fake=False)

    for name in LOGGED_METHODS:
        if hasattr(core.ProcessGroupGloo, name):
            patcher.set(core.ProcessGroupGloo, name, _make_logged(getattr(core.ProcessGroupGloo, name), _OP[name],
                                                                   probe))
    from ...gloo import collectives

    patcher.set(collectives, "reduce_scatter_on_gloo",
                _make_logged_reduce_scatter(collectives.reduce_scatter_on_gloo, probe))
    import paddle.distributed.collective as collective

    original = collective._new_process_group_impl

    def _new_process_group_impl(backend, store, rank, world_size, group_name, pg_options, group_id=0, *a, **k):
        from ...gloo.groups import _members_being_created

        pg = original(backend, store, rank, world_size, group_name, pg_options, group_id, *a, **k)
        members = _members_being_created(world_size)
        probe.groups[id(pg)] = members if members is not None else list(range(world_size))
        return pg

    import paddle.distributed.parallel as parallel

    patcher.set(collective, "_new_process_group_impl", _new_process_group_impl)
    patcher.set(parallel, "_new_process_group_impl", _new_process_group_impl)


COMPONENT = Component("dryrun_probe", ("3.2.", "3.3."), "dryrun_probe", apply)
