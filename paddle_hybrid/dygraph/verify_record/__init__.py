"""What a run made by ``python -m paddle_hybrid.verify`` records: every step's loss, step 1's
gradients as the optimizer applied them, and every parameter at its whole (one-process) shape and
name (:mod:`.names`: virtual chunks, expert shards) before the first update, after step 1 and at
the end, with what :mod:`paddle_hybrid.common.replicas` needs to tell
which replicas differ (component ``verify_record``, on when ``PluginConfig.verify_dir`` is set:
``PADDLE_HYBRID_VERIFY_DIR``).

The verifier writes ``plan.json`` into that directory before it starts the run:
``{"layout": "tp2", "degrees": {"mp": 2, ...}, "set_degrees": bool, "seeded_init": bool,
"reference": bool, "gradient_rtol": float}``; the reference run (one process) also accumulates
each parameter element's rounding allowance (:class:`RoundingAllowance`).

* ``set_degrees`` (a plain fleet script, whose degrees are its own): ``fleet.init`` gets the
  plan's degrees in its strategy's ``hybrid_configs``.
* ``seeded_init`` (a script whose weights depend on the layout): at ``fleet.distributed_model``
  every parameter of two or more dimensions is drawn again, N(0, 0.02) from a generator seeded by
  its name, at its whole shape, and this rank keeps its slice: every layout starts from the same
  model.  (A Trainer script loads its checkpoint; ``examples/gpt_pp.py`` draws its weights by
  name: neither needs it.)

Where the numbers come from:

* a **Trainer** (PaddleFormers): a callback added to every ``Trainer`` (through an import hook on
  ``paddleformers.trainer.trainer``): the loss it logs (the verifier asks for
  ``--logging_steps 1``), the model at step 1 and at the end of training;
* a **fleet script**: ``fleet.distributed_optimizer``'s optimizer (or ``group_sharded_parallel``'s:
  its ``step`` counts steps), the loss of ``PipelineParallel.train_batch`` or, without a pipeline,
  the sum of the scalars ``backward()`` was called on in that step (a script that accumulates
  scales each micro-batch's loss by 1 / micro-batches: the sum is the step's mean loss); the model
  ``fleet.distributed_model`` (or ``group_sharded_parallel``) returned; the start at the first
  optimizer pass (before any update), the end at the process's exit.

* **gradients**: ``Optimizer._create_optimization_pass``, where every Paddle optimizer (the
  innermost, under fleet's and sharding's wrappers) hands over its (parameter, gradient) pairs
  after reductions and clipping, just before its update rule.

Written into the directory, per rank: ``rank<R>.json`` (its coordinates, its losses, its replica
descriptions, how its gradient slices join), ``grads.rank<R>.npz`` (step 1's gradients of the
parameters this rank updated, its slices; a group-sharded stage-3 slice with its place in the
group) and, from one rank of each pipeline stage (tensor-parallel rank 0 of the first data,
sharding and sep replica; every other rank its own experts, each held whole: an MoE layer's experts
with an expert-parallel group, or marked ``expert`` / ``no_sync``), ``params.rank<R>.<label>.npz`` with
whole values (``label`` start, step1, end); the reference run also
``allowance.rank<R>.<label>.npz`` (step1, end).
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import zlib

from ...common import logical_params
from ...common.replicas import describe_rank, expert_shards, group_sharded, inner_layer, sliced_by_stage3
from ...registry.component import Component
from .names import one_process_names, places

__all__ = ["COMPONENT", "apply", "Recorder", "VARIANT"]

VARIANT = "::"  # "name::by_part": another candidate whole value of a fused projection (logical_params.whole)


class Recorder:
    """One rank's record, written to ``directory`` as it grows."""

    def __init__(self, directory: str, plan: dict):
        import paddle.distributed as dist

        self.directory, self.plan = directory, plan
        self.rank = dist.get_rank() if dist.get_world_size() > 1 else 0
        self.losses: dict = {}
        self.pending: list = []  # scalars backward() was called on since the last step
        self.steps = 0
        self.model = None
        self.in_pipeline = False
        self.trainer = False
        self.replicas: dict = {}
        self.done = False
        self.gradients: dict = {}  # id(parameter) -> (parameter, gradient), step 1
        self.gradient_meta: dict = {}  # name -> how its recorded gradient joins the other ranks' (compare.load)
        # the run every layout is compared with bounds what rounding can do to each element
        rtol = plan.get("gradient_rtol")
        self.allowance = RoundingAllowance(float(rtol)) if plan.get("reference") and rtol else None

    # -- what a step leaves ----------------------------------------------------------------------

    def loss_seen(self, value: float) -> None:
        if not self.in_pipeline:
            self.pending.append(value)

    def step_done(self, loss: float | None = None) -> None:
        self.steps += 1
        if loss is None and self.pending:
            # a script accumulating gradients scales each micro-batch's loss by 1 / micro-batches
            # before backward(): the sum is the step's mean loss (what a pipeline's train_batch gives)
            loss = sum(self.pending)
        self.pending = []
        if loss is not None:
            self.losses[self.steps] = float(loss)
        if self.allowance is not None:
            self.allowance.settle()
        if self.steps == 1:
            self.snapshot("step1")
        self.write()

    def gradients_seen(self, params_grads) -> None:
        """The gradients the optimizer is about to apply, as its update rule sees them: after
        every reduction (data parallel, sharding, tied weights, sequence parallel) and after
        clipping; with sharding only this rank's own parameters.  Step 1's are kept (a copy, no
        collective) and named at the step-1 snapshot, when the model is known; every step's feed
        the reference run's allowance."""
        if self.steps != 0 and self.allowance is None:
            return
        if self.steps == 0 and "start" not in self.replicas:
            self.snapshot("start")  # the model every layout must start from, before its first update
        pairs = params_grads["params"] if isinstance(params_grads, dict) else params_grads
        for param, grad in pairs:
            if grad is None:
                continue
            value = logical_params._array(grad)
            if self.steps == 0:
                self.gradients[id(param)] = (param, value)
            if self.allowance is not None:
                self.allowance.before_update(param, value, self.steps + 1)

    # -- parameters ------------------------------------------------------------------------------

    def _writer(self) -> bool:
        """One rank per pipeline stage writes whole values: the first of its data, sharding and
        segment-parallel replicas, tensor-parallel rank 0.  (The others write their experts only.)"""
        c = coordinates()
        return (c["mp"], c["dp"], c["sharding"], c["sep"]) == (0, 0, 0, 0)

    def snapshot(self, label: str) -> None:
        """Whole values of every parameter (a collective over the tensor-parallel group, and over
        the group-sharded group for stage 3's slices), and this rank's replica description;
        ``label`` is "start" (before the first update), "step1" or "end"."""
        import numpy as np

        if self.model is None:
            return
        mp = logical_params.groups().get("mp", (None, None))[0]
        config = getattr(inner_layer(self.model), "config", None)
        named = one_process_names(self.model)
        slices = sliced_by_stage3(self.model)
        experts = _expert_ids(self.model)
        writer = self._writer()
        values, shapes = {}, {}
        for name, param in named:
            if param.name in slices:
                value = {"": _stage3_whole(param, group_sharded(self.model)[1])}
            elif id(param) in experts:
                # whole on the rank holding it (PaddleFormers marks an expert is_distributed: not a slice)
                value = {"": logical_params._array(param)}
            else:
                try:
                    value = logical_params.whole(param, mp, name, config)
                except logical_params.NoSplitAxisError:
                    value = {"": logical_params._array(param)}
            if writer or _own(param) or id(param) in experts:
                for variant, array in value.items():
                    values[name + (VARIANT + variant if variant else "")] = array
            shapes[name] = {"local": list(param.shape), "split": logical_params.is_split(param),
                            "trained": not param.stop_gradient}
        self.replicas[label] = describe_rank(self.model, named)
        self.replicas[label]["shapes"] = shapes
        self.replicas[label]["aliases"] = logical_params.aliases(inner_layer(self.model))
        self.replicas[label]["places"] = places(self.model, coordinates()["pp"])
        if values:
            np.savez(os.path.join(self.directory, f"params.rank{self.rank}.{label}.npz"), **values)
        if label == "step1":
            self._write_gradients(mp, config, named)
        if self.allowance is not None and label != "start":
            np.savez(os.path.join(self.directory, f"allowance.rank{self.rank}.{label}.npz"),
                     **self.allowance.arrays(named))

    def _write_gradients(self, mp, config, named) -> None:
        """Step 1's gradients, this rank's slices as recorded (every rank writes its own: with
        sharding each rank applied only its share), with what joins them into whole ones: the
        split axis, this rank's place in the tensor-parallel group, the fused parts; for a
        stage-3 slice its place in the group-sharded group and the parameter's shape."""
        import numpy as np

        arrays = {}
        slices = sliced_by_stage3(self.model)
        experts = _expert_ids(self.model)
        for name, param in named:
            # stage 3 hands the optimizer a slice parameter of its own (``fw_storage``) for a sliced one
            holder = getattr(param, "fw_storage", None) if param.name in slices else param
            seen = self.gradients.pop(id(holder), None)
            if seen is None:
                continue
            # an expert is whole on the rank holding it (PaddleFormers marks it is_distributed all the same)
            split = logical_params.is_split(param) and mp is not None and mp.nranks > 1 and id(param) not in experts
            axis = getattr(param, "split_axis", None)
            if split and axis is None:
                continue  # its whole value is unknown (the parameters say so: NoSplitAxisError)
            arrays[name] = seen[1]
            self.gradient_meta[name] = {"axis": int(axis) if split else None, "mp_rank": mp.rank if split else 0,
                                        "mp_size": mp.nranks if split else 1,
                                        "parts": logical_params.fused_parts(name, config) if split else None}
            if param.name in slices:
                group = group_sharded(self.model)[1]
                self.gradient_meta[name]["shard"] = {"rank": group.rank, "size": group.nranks,
                                                     "shape": list(param.shape)}
        self.gradients.clear()
        if arrays:
            np.savez(os.path.join(self.directory, f"grads.rank{self.rank}.npz"), **arrays)

    def finish(self) -> None:
        if self.done or self.steps == 0:
            return
        self.done = True
        self.snapshot("end")
        self.write()

    def write(self) -> None:
        record = {"rank": self.rank, "coords": coordinates(), "losses": self.losses, "steps": self.steps,
                  "replicas": self.replicas, "layout": self.plan.get("layout"), "gradients": self.gradient_meta}
        with open(os.path.join(self.directory, f"rank{self.rank}.json"), "w") as f:
            json.dump(record, f)


def _expert_ids(model) -> set:
    """``id`` of every parameter of this rank's experts (the MoE layers with an expert-parallel group of 2
    or more: :func:`~paddle_hybrid.common.replicas.expert_shards`); each is this rank's own, held whole."""
    return {id(p) for _path, layer, _group in expert_shards(model) for p in layer.experts.parameters()}


def _own(param) -> bool:
    """A parameter this rank holds and no writer does: an expert of its own (expert parallel)."""
    return bool(getattr(param, "expert", False) or getattr(param, "no_sync", False))


def _stage3_whole(param, group):
    """The whole value of a parameter group-sharded stage 3 keeps as one slice a rank (between
    steps in ``param.fw_storage``; the slices in rank order, padded at the end): a collective
    over the group."""
    import numpy as np
    import paddle.distributed as dist

    parts = []
    dist.all_gather(parts, param.fw_storage, group=group)
    flat = np.concatenate([logical_params._array(p).reshape(-1) for p in parts])
    return flat[:int(np.prod(param.shape))].reshape(param.shape)


class RoundingAllowance:
    """How far rounding alone can move each element of each parameter, accumulated over the
    steps of the run every layout is compared with (one process).

    Each step a layout's gradients may differ from one process's by rounding, up to the
    verifier's ``gradient_rtol`` times the tensor's largest gradient so far (the bound its
    step-1 comparison enforces).  What that does to an element's update depends on the element's
    own gradient ``g``: an optimizer that divides by a running magnitude of ``g`` (Adam: the
    update is ``lr * m / (sqrt(v) + eps)``, at step 1 ``lr * g / (|g| + eps)``) changes the
    update by up to ``|dg| / |g|`` of it (``sqrt(t)`` more at step ``t``, where ``v`` averages
    ``t`` steps), and by at most the whole update twice over (the sign of a ``g`` made of
    rounding can go either way); plain SGD by ``lr * dg``, less.  So an element gets, each step,
    ``U * min(2, 2 * sqrt(t) * gradient_rtol * G / |g|)``, ``U`` the largest change the step made
    to any element of the tensor here and ``G`` the tensor's largest gradient so far: about zero
    for an element with a gradient of its own, up to ``2 U`` for one whose gradient is made of
    rounding.  The sum over the steps is the allowance :mod:`paddle_hybrid.verify.compare` adds
    to that element's tolerance."""

    def __init__(self, gradient_rtol: float):
        self.gradient_rtol = gradient_rtol
        self.entries: dict = {}  # id(parameter) -> {"param", "total", "peak", and during a step "before", "factor"}

    def before_update(self, param, grad, step: int) -> None:
        import math

        import numpy as np

        magnitude = np.abs(grad.astype("float64"))
        entry = self.entries.setdefault(id(param), {"param": param, "total": np.zeros(grad.shape), "peak": 0.0})
        entry["peak"] = max(entry["peak"], float(magnitude.max()) if magnitude.size else 0.0)
        bound = 2.0 * math.sqrt(step) * self.gradient_rtol * entry["peak"]
        with np.errstate(divide="ignore", invalid="ignore"):
            factor = np.where(magnitude > 0, bound / magnitude, np.inf)
        entry["factor"] = np.minimum(2.0, factor)
        entry["before"] = logical_params._array(param).astype("float64")

    def settle(self) -> None:
        """After a step: each element's share of what the step moved its tensor."""
        import numpy as np

        for entry in self.entries.values():
            if "factor" in entry:
                moved = np.abs(logical_params._array(entry["param"]).astype("float64") - entry.pop("before"))
                entry["total"] += (float(moved.max()) if moved.size else 0.0) * entry.pop("factor")

    def arrays(self, named) -> dict:
        return {name: self.entries[id(p)]["total"].astype("float32") for name, p in named if id(p) in self.entries}


def coordinates() -> dict:
    """This rank's place: ``{"mp": rank, "dp": ..., "sharding": ..., "pp": ..., "mp_size": ...}``."""
    from paddle.distributed import fleet

    try:
        hcg = fleet.get_hybrid_communicate_group()
    except Exception:  # noqa: BLE001
        hcg = None
    if hcg is None:
        return {"mp": 0, "dp": 0, "sharding": 0, "sep": 0, "pp": 0, "pp_size": 1, "mp_size": 1}
    sep = hcg.get_sep_parallel_rank() if hasattr(hcg, "get_sep_parallel_rank") else 0
    return {"mp": hcg.get_model_parallel_rank(), "dp": hcg.get_data_parallel_rank(),
            "sharding": hcg.get_sharding_parallel_rank(), "sep": sep, "pp": hcg.get_stage_id(),
            "pp_size": hcg.get_pipe_parallel_world_size(), "mp_size": hcg.get_model_parallel_world_size()}


_state: dict = {"recorder": None}


def _recorder(config) -> Recorder:
    if _state["recorder"] is None:
        with open(os.path.join(config.verify_dir, "plan.json")) as f:
            plan = json.load(f)
        _state["recorder"] = Recorder(config.verify_dir, plan)
        atexit.register(_state["recorder"].finish)
    return _state["recorder"]


# -- seeded start ------------------------------------------------------------------------------------

def seeded_init(model) -> None:
    """Every parameter of two or more dimensions drawn from N(0, 0.02) by its name at its whole
    shape; this rank keeps its slice."""
    import numpy as np
    import paddle

    mp = logical_params.groups().get("mp", (None, None))[0]
    mp_size, mp_rank = (mp.nranks, mp.rank) if mp is not None else (1, 0)
    for name, param in logical_params.named_parameters(model):
        if len(param.shape) < 2:
            continue
        shape = list(param.shape)
        axis = getattr(param, "split_axis", None) if logical_params.is_split(param) else None
        if axis is not None:
            shape[int(axis)] *= mp_size
        value = np.random.default_rng(zlib.crc32(name.encode())).normal(0.0, 0.02, shape).astype("float32")
        if axis is not None:
            value = np.split(value, mp_size, axis=int(axis))[mp_rank]
        with paddle.no_grad():
            param.set_value(paddle.to_tensor(value).astype(param.dtype))


# -- where it hooks in -------------------------------------------------------------------------------

def _make_fleet_init(original, plan):
    @functools.wraps(original)
    def init(*args, **kwargs):
        strategy = kwargs.get("strategy")
        if strategy is None:
            from paddle.distributed import fleet

            strategy = fleet.DistributedStrategy()
            kwargs["strategy"] = strategy
        configs = dict(strategy.hybrid_configs)
        names = {"mp": "mp_degree", "pp": "pp_degree", "dp": "dp_degree", "sharding": "sharding_degree",
                 "sep": "sep_degree"}
        for kind, key in names.items():
            configs[key] = int(plan["degrees"].get(kind, 1))
        strategy.hybrid_configs = {k: v for k, v in configs.items() if k in names.values()}
        return original(*args, **kwargs)

    return init


def _make_distributed_model(original, config):
    @functools.wraps(original)
    def distributed_model(model, *args, **kwargs):
        recorder = _recorder(config)
        if recorder.plan.get("seeded_init"):
            seeded_init(model)
        wrapped = original(model, *args, **kwargs)
        if not recorder.trainer:
            recorder.model = wrapped
        return wrapped

    return distributed_model


def _record_steps(optimizer, config) -> None:
    """Each ``optimizer.step()`` ends a step of the record."""
    step = optimizer.step

    @functools.wraps(step)
    def recorded_step(*a, **k):
        result = step(*a, **k)
        recorder = _recorder(config)
        if not recorder.trainer:
            recorder.step_done()
        return result

    optimizer.step = recorded_step


def _make_distributed_optimizer(original, config):
    @functools.wraps(original)
    def distributed_optimizer(*args, **kwargs):
        optimizer = original(*args, **kwargs)
        _record_steps(optimizer, config)
        return optimizer

    return distributed_optimizer


def _make_group_sharded_parallel(original, config):
    """``group_sharded_parallel`` (stages 2 and 3) is the model's and the optimizer's wrapper
    instead of ``fleet.distributed_model`` / ``distributed_optimizer``."""
    @functools.wraps(original)
    def group_sharded_parallel(model, optimizer, *args, **kwargs):
        recorder = _recorder(config)
        if recorder.plan.get("seeded_init"):
            seeded_init(model)
        model, optimizer, scaler = original(model, optimizer, *args, **kwargs)
        if not recorder.trainer:
            recorder.model = model
            _record_steps(optimizer, config)
        return model, optimizer, scaler

    return group_sharded_parallel


def _make_optimization_pass(original, config):
    @functools.wraps(original)
    def _create_optimization_pass(self, parameters_and_grads, *args, **kwargs):
        _recorder(config).gradients_seen(parameters_and_grads)
        return original(self, parameters_and_grads, *args, **kwargs)

    return _create_optimization_pass


def _make_backward(original, config):
    @functools.wraps(original)
    def backward(self, *args, **kwargs):
        if self.size == 1:
            _recorder(config).loss_seen(float(self))
        return original(self, *args, **kwargs)

    return backward


def _make_train_batch(original, config):
    @functools.wraps(original)
    def train_batch(self, *args, **kwargs):
        recorder = _recorder(config)
        recorder.in_pipeline, steps_before = True, recorder.steps
        try:
            loss = original(self, *args, **kwargs)
        finally:
            recorder.in_pipeline = False
        if loss is not None and not recorder.trainer:
            value = float(loss.reshape([-1]).numpy()[0])  # [1] or [] as the schedule returns it
            if recorder.steps > steps_before:  # the optimizer was given to train_batch and stepped in it
                recorder.losses[recorder.steps] = value
                recorder.write()
            else:
                recorder.pending = [value]
        return loss

    return train_batch


def _trainer_callback(config):
    from paddleformers.trainer import TrainerCallback

    class VerifyRecorder(TrainerCallback):
        """The Trainer's logged loss each step, the model at step 1 and at the end."""

        def on_step_end(self, args, state, control, model=None, **kwargs):
            recorder = _recorder(config)
            recorder.model = model if model is not None else recorder.model
            recorder.steps = int(state.global_step)
            if recorder.allowance is not None:
                recorder.allowance.settle()
            if recorder.steps == 1:
                recorder.snapshot("step1")
            recorder.write()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                recorder = _recorder(config)
                recorder.losses[int(state.global_step)] = float(logs["loss"])
                recorder.write()

        def on_train_end(self, args, state, control, model=None, **kwargs):
            recorder = _recorder(config)
            recorder.model = model if model is not None else recorder.model
            recorder.finish()

    return VerifyRecorder()


def _hook_trainer(config, patcher):
    def fix(trainer_module):
        original = patcher.require(trainer_module.Trainer, "__init__", "paddleformers.trainer.trainer.Trainer")

        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            _recorder(config).trainer = True
            original(self, *args, **kwargs)
            self.add_callback(_trainer_callback(config))

        patcher.set(trainer_module.Trainer, "__init__", __init__)

    from ...common.import_hook import when_imported

    patcher.on_revert(when_imported("paddleformers.trainer.trainer", fix), "verify_record: Trainer import hook")


def _pipeline_classes(base) -> list:
    found, todo = [], [base]
    while todo:
        cls = todo.pop()
        if "train_batch" in cls.__dict__:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def apply(config, patcher) -> str:
    import paddle
    from paddle.distributed import fleet
    from paddle.distributed.fleet.meta_parallel import PipelineParallel, pipeline_parallel

    with open(os.path.join(config.verify_dir, "plan.json")) as f:
        plan = json.load(f)
    if plan.get("set_degrees"):
        patcher.set(fleet, "init", _make_fleet_init(patcher.require(fleet, "init", "paddle.distributed.fleet"), plan))
    patcher.set(fleet, "distributed_model",
                _make_distributed_model(patcher.require(fleet, "distributed_model", "paddle.distributed.fleet"), config))
    patcher.set(fleet, "distributed_optimizer", _make_distributed_optimizer(
        patcher.require(fleet, "distributed_optimizer", "paddle.distributed.fleet"), config))
    patcher.set(paddle.Tensor, "backward", _make_backward(patcher.require(paddle.Tensor, "backward", "paddle.Tensor"),
                                                          config))
    # the one place every optimizer of Paddle's (the innermost, under fleet's and sharding's
    # wrappers) hands over its (parameter, gradient) pairs after clipping, just before updating
    base = paddle.optimizer.Optimizer
    patcher.set(base, "_create_optimization_pass", _make_optimization_pass(
        patcher.require(base, "_create_optimization_pass", "paddle.optimizer.Optimizer"), config))
    # every pipeline schedule (the interleaved one has a train_batch of its own; one process a
    # PipelineLayer runs in NoPipelineParallel's)
    # (NoPipelineParallel: Paddle 3.3; 3.2 gives one process the PipelineLayer itself)
    one_process = getattr(pipeline_parallel, "NoPipelineParallel", None)
    for cls in _pipeline_classes(PipelineParallel) + (_pipeline_classes(one_process) if one_process else []):
        patcher.set(cls, "train_batch", _make_train_batch(cls.__dict__["train_batch"], config))
    _hook_group_sharded(config, patcher)
    _hook_trainer(config, patcher)
    return f"recording layout {plan.get('layout')} into {config.verify_dir}"


def _hook_group_sharded(config, patcher) -> None:
    """``paddle.distributed.sharding.group_sharded_parallel``, where scripts import it from (the
    package and its module)."""
    import paddle.distributed.sharding as sharding
    from paddle.distributed.sharding import group_sharded

    original = patcher.require(group_sharded, "group_sharded_parallel", "paddle.distributed.sharding.group_sharded")
    wrapped = _make_group_sharded_parallel(original, config)
    patcher.set(group_sharded, "group_sharded_parallel", wrapped)
    if getattr(sharding, "group_sharded_parallel", None) is original:
        patcher.set(sharding, "group_sharded_parallel", wrapped)


COMPONENT = Component("verify_record", ("3.2.", "3.3."), "verify_dir", apply)
