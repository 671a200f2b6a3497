"""The state of Paddle's fused FSDP (``fully_shard`` in auto-parallel mode) read and written whole.

Paddle 3.3's ``FullyShardFusion`` (``auto_parallel/fully_shard_fusion.py``) copies every parameter
into one fused buffer per group, keeps on each rank only its contiguous piece of that buffer
(``params_buffer.data_buffer``), and frees the parameters: between forwards a parameter is a
replicated DistTensor with no storage (``numpy()`` gives a zero-size array), bound to gathered
data only inside its layer's forward and backward.  The optimizer updates the pieces; nothing
writes the trained values back to the parameters.  Its optimizer state is per fused buffer
(accumulators named after ``fuse_params_<group>``), so nothing that reads a parameter or saves a
checkpoint by parameter name finds it.

This module is what the fixes of both the fleet and the PaddleFormers sides use:

- :func:`gather_parameters` / :func:`release_parameters`: every parameter given its trained value
  (an all-gather per group over the FSDP group; collective) / freed again as FSDP frees it;
  :func:`whole_parameters` does both around a block, leaving parameters that were whole as they were;
- :func:`scatter_parameters`: the parameters' values written into this rank's buffer pieces (after
  a checkpoint was loaded into them);
- :func:`optimizer_state_shards` / :func:`write_optimizer_state`: the fused optimizer state as
  per-parameter flex-checkpoint entries (``<key>.moment1_0`` ...) over this rank's piece only
  (flattened ranges, so nothing is gathered), and loaded values placed back into the buffers.

Layout of a group: parameter ``p`` occupies ``[offset(p), offset(p) + numel(p))`` of the fused
buffer (each followed by alignment padding); rank ``r`` of ``n`` holds ``[r * L, (r + 1) * L)``
with ``L = total / n`` (the total is padded to a multiple of ``n``).
"""
from __future__ import annotations

import contextlib

__all__ = ["FusedFSDPStateError", "context", "parameters_are_whole", "gather_parameters", "release_parameters",
           "whole_parameters", "scatter_parameters", "optimizer_state_shards", "write_optimizer_state",
           "ensure_optimizer_state"]


class FusedFSDPStateError(RuntimeError):
    """Fused-FSDP state that cannot be read or placed back as asked."""


def context():
    """The fused-FSDP context of this process (Paddle registers the newest one), or None."""
    try:
        from paddle.distributed.auto_parallel.fully_shard_fusion import get_fsdp_context
    except ImportError:  # Paddle 3.2: no fused FSDP
        return None
    return get_fsdp_context()


def _groups(fsdp):
    return fsdp.buffer_manager.buffer_groups


def _piece(fsdp, buffer) -> tuple[int, int]:
    """[start, stop) of the fused buffer held by this rank."""
    import paddle

    length = int(buffer.data_buffer.shape[0])
    rank = list(fsdp.buffer_manager._fsdp_group.ranks).index(paddle.distributed.get_rank())
    return rank * length, rank * length + length


def _numel(param) -> int:
    n = 1
    for d in param.shape:
        n *= int(d)
    return n


def parameters_are_whole(fsdp) -> bool:
    """Whether every fused parameter holds a value (after :func:`gather_parameters`, before the next
    forward frees it again)."""
    return all(param._is_initialized() for group in _groups(fsdp) for param in group.params)


def _bind(param, local) -> None:
    """Make the (replicated DistTensor) parameter hold ``local`` (a dense tensor of its shape) as its
    own storage, keeping its stop_gradient."""
    import paddle

    stop_gradient = param.stop_gradient
    value = paddle.Tensor(local, dims=list(param.shape), process_mesh=param.process_mesh,
                          placements=param.placements, place=local.place)
    param.get_tensor()._share_data_with(value.get_tensor())
    param.stop_gradient = stop_gradient


def gather_parameters(fsdp) -> None:
    """Every fused parameter gets its current (trained) value: each group's pieces all-gathered over
    the FSDP group, each parameter a copy of its range.  Collective: every rank of the FSDP group
    calls it at the same point."""
    import paddle

    with paddle.no_grad():
        for group in _groups(fsdp):
            buffer = group.params_buffer
            whole = paddle.empty([buffer.total_buffer_size], dtype=buffer.data_buffer.dtype)
            fsdp.buffer_manager._fsdp_group.process_group.all_gather(buffer.data_buffer, whole).wait()
            for param in group.params:
                offset = buffer.param_offsets[param.name]
                local = whole._slice(offset, offset + _numel(param)).reshape(list(param.shape)).clone()
                _bind(param, local)
            del whole


def release_parameters(fsdp) -> None:
    """Free every fused parameter's storage again, as FSDP's own post-forward does (the shape kept)."""
    for group in _groups(fsdp):
        for param in group.params:
            stop_gradient = param.stop_gradient
            local_shape = param._local_shape
            param._clear_data()
            param.stop_gradient = stop_gradient
            param._local_value().get_tensor()._set_dims(local_shape)


@contextlib.contextmanager
def whole_parameters(fsdp, write_back: bool = False):
    """Parameters whole inside the block; on exit, with ``write_back``, their values written into
    this rank's pieces (a load into them); then freed again unless they were whole before.

    Parameters that are whole already are not gathered again: they hold the newest values (gathered
    after training, or loaded into and not yet written back), which a gather from the pieces would
    overwrite.  Every rank of the FSDP group is in the same state here, so the gather is collective
    on all or on none."""
    was_whole = parameters_are_whole(fsdp)
    if not was_whole:
        gather_parameters(fsdp)
    try:
        yield
        if write_back:
            scatter_parameters(fsdp)
    finally:
        if not was_whole:
            release_parameters(fsdp)


def scatter_parameters(fsdp) -> None:
    """This rank's piece of every group's buffer set from the parameters' values (whole parameters)."""
    import paddle

    with paddle.no_grad():
        for group in _groups(fsdp):
            buffer = group.params_buffer
            start, stop = _piece(fsdp, buffer)
            for param in group.params:
                begin = buffer.param_offsets[param.name]
                lo, hi = max(begin, start), min(begin + _numel(param), stop)
                if lo >= hi:
                    continue
                flat = param._local_value().reshape([-1])
                paddle.assign(flat._slice(lo - begin, hi - begin), buffer.data_buffer._slice(lo - start, hi - start))


# --------------------------------------------------------------------------- optimizer state


def _inner_optimizer(optimizer):
    """The optimizer that owns the accumulators (through Paddle's and fleet's wrappers)."""
    seen = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = optimizer.__dict__.get("_inner_opt") or optimizer.__dict__.get("_optim")
        if inner is None:
            break
        optimizer = inner
    return optimizer


def _trainable_groups(fsdp):
    return [group for group in _groups(fsdp) if not group.params_buffer.data_buffer.stop_gradient]


def ensure_optimizer_state(fsdp, optimizer) -> None:
    """The optimizer's accumulators of every trainable fused buffer made (Paddle makes them lazily at
    the first step; a resume loads into them before it)."""
    import paddle

    inner = _inner_optimizer(optimizer)
    buffers = [group.params_buffer.data_buffer for group in _trainable_groups(fsdp)]
    missing = [b for b in buffers if not _accumulators_of(inner, b.name)]
    if missing:
        inner._create_accumulators(paddle.base.framework.default_main_program().global_block(), missing)


def _accumulators_of(inner, buffer_name: str) -> dict:
    """{suffix ("moment1_0", "beta1_pow_acc_0", ...): tensor} of one fused buffer."""
    found = {}
    for per_param in getattr(inner, "_accumulators", {}).values():
        tensor = per_param.get(buffer_name)
        if tensor is None:
            continue
        prefix = buffer_name + "_"
        if not tensor.name.startswith(prefix):
            raise FusedFSDPStateError(
                f"the optimizer accumulator {tensor.name!r} of the fused buffer {buffer_name!r} is not named after "
                "it; this Paddle's optimizer differs from the one paddle_hybrid's fused-FSDP checkpoints were "
                "written for")
        found[tensor.name[len(prefix):]] = tensor
    return found


def _check_no_master_weights(inner) -> None:
    if getattr(inner, "_master_weights", None):
        raise FusedFSDPStateError(
            "the optimizer keeps master weights of the fused-FSDP buffers (multi-precision training); "
            "paddle_hybrid's fused-FSDP checkpoints cover float32 parameters and their optimizer state only. "
            "Train in float32, or set PADDLE_HYBRID_PADDLEFORMERS_FIXES=0 (Paddle's own save then fails on "
            "the freed parameters)")


def _struct_names(model_sharded_state_dict) -> dict:
    """{parameter name: its checkpoint key}; a tied parameter under its first key in sorted order, as
    Paddle's optimizer ``sharded_state_dict`` maps it."""
    names = {}
    for key in sorted(model_sharded_state_dict):
        names.setdefault(model_sharded_state_dict[key].local_tensor.name, key)
    return names


def optimizer_state_shards(fsdp, optimizer, model_sharded_state_dict, copy: bool = False) -> dict:
    """{``<key>.<state>``: ShardedWeight}: every fused buffer's optimizer state per parameter.

    A state of the buffer's length (moments) becomes, for each parameter with a range in this
    rank's piece, a flattened entry over that range (global shape the parameter's); a scalar state
    (beta powers) an entry per parameter on every rank.  With ``copy`` the entries hold fresh
    tensors (targets of a load, written back by :func:`write_optimizer_state`); otherwise views of
    the accumulators (a save)."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    inner = _inner_optimizer(optimizer)
    _check_no_master_weights(inner)
    keys = _struct_names(model_sharded_state_dict)
    shards = {}
    for group in _trainable_groups(fsdp):
        buffer = group.params_buffer
        start, stop = _piece(fsdp, buffer)
        for suffix, state in sorted(_accumulators_of(inner, buffer.data_buffer.name).items()):
            scalar = int(state.numel()) == 1
            if not scalar and int(state.shape[0]) != stop - start:
                raise FusedFSDPStateError(
                    f"the optimizer state {state.name!r} has {int(state.shape[0])} elements where its fused buffer "
                    f"piece has {stop - start}; it cannot be split by parameter")
            for param in group.params:
                key = keys.get(param.name)
                if key is None:
                    raise FusedFSDPStateError(
                        f"the fused parameter {param.name!r} is not in the model's sharded state dict; its optimizer "
                        "state would not be saved")
                shard = _state_shard(f"{key}.{suffix}", state, scalar, param, buffer, start, stop, copy,
                                     ShardedWeight)
                if shard is not None:
                    shards[shard.key] = shard
    return shards


def _state_shard(key, state, scalar, param, buffer, start, stop, copy, sharded_weight):
    shape = tuple(int(d) for d in param.shape)
    if scalar:
        local = state.clone() if copy else state
        return sharded_weight(key=key, local_tensor=local, local_shape=(1,), global_shape=(1,), global_offset=(0,))
    begin = buffer.param_offsets[param.name]
    lo, hi = max(begin, start), min(begin + _numel(param), stop)
    if lo >= hi:
        return None
    local = state._slice(lo - start, hi - start)
    if copy:
        local = local.clone()
    shard = sharded_weight(key=key, local_tensor=local, local_shape=shape, global_shape=shape,
                           global_offset=(0,) * len(shape), is_flattened=True, flattened_range=slice(lo - begin, hi - begin))
    shard._ph_piece = (lo - start, hi - start)
    return shard


def write_optimizer_state(fsdp, optimizer, model_sharded_state_dict, loaded: dict) -> None:
    """The values of ``loaded`` (:func:`optimizer_state_shards` with ``copy=True``, after a load)
    placed into the fused buffers' accumulators.  A scalar state must be alike for every parameter
    of a group (one accumulator holds it); a checkpoint where it differs is refused."""
    import paddle

    inner = _inner_optimizer(optimizer)
    keys = _struct_names(model_sharded_state_dict)
    with paddle.no_grad():
        for group in _trainable_groups(fsdp):
            buffer = group.params_buffer
            for suffix, state in _accumulators_of(inner, buffer.data_buffer.name).items():
                scalar = int(state.numel()) == 1
                values = []
                for param in group.params:
                    shard = loaded.get(f"{keys[param.name]}.{suffix}")
                    if shard is None:
                        continue
                    if scalar:
                        values.append((param.name, float(shard.local_tensor.numpy().reshape(-1)[0])))
                    else:
                        lo, hi = shard._ph_piece
                        paddle.assign(shard.local_tensor.reshape([-1]), state._slice(lo, hi))
                if scalar and values:
                    if len({v for _, v in values}) > 1:
                        raise FusedFSDPStateError(
                            f"the checkpoint's {suffix} differs between parameters of one fused-FSDP group "
                            f"({values[:4]}...): one accumulator holds it for the group here")
                    paddle.assign(paddle.full(state.shape, values[0][1], dtype=state.dtype), state)
