"""What a run made by ``python -m paddle_hybrid.verify`` records: every step's loss, and every
parameter at its whole (one-process) shape and name after step 1 and at the end, with what
:mod:`paddle_hybrid.common.replicas` needs to tell which replicas differ (component
``verify_record``, on when ``PluginConfig.verify_dir`` is set: ``PADDLE_HYBRID_VERIFY_DIR``).

The verifier writes ``plan.json`` into that directory before it starts the run:
``{"layout": "tp2", "degrees": {"mp": 2, ...}, "set_degrees": bool, "seeded_init": bool}``.

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
* a **fleet script**: ``fleet.distributed_optimizer``'s optimizer (its ``step`` counts steps), the
  loss of ``PipelineParallel.train_batch`` or, without a pipeline, the sum of the scalars
  ``backward()`` was called on in that step (a script that accumulates scales each micro-batch's
  loss by 1 / micro-batches: the sum is the step's mean loss); the model ``fleet.distributed_model`` returned; the
  end at the process's exit.

Written into the directory, per rank: ``rank<R>.json`` (its coordinates, its losses, its replica
descriptions) and, from one rank of each pipeline stage (tensor-parallel rank 0 of the first data
and sharding replica), ``params.rank<R>.<label>.npz`` with whole values.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import zlib

from ...common import logical_params
from ...common.replicas import describe_rank
from ...registry.component import Component

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
        if self.steps == 1:
            self.snapshot("step1")
        self.write()

    # -- parameters ------------------------------------------------------------------------------

    def _writer(self) -> bool:
        """One rank per pipeline stage writes whole values: the first of its data and sharding
        replicas, tensor-parallel rank 0."""
        from paddle.distributed import fleet

        try:
            hcg = fleet.get_hybrid_communicate_group()
        except Exception:  # noqa: BLE001
            return True
        if hcg is None:
            return True
        return (hcg.get_model_parallel_rank(), hcg.get_data_parallel_rank(), hcg.get_sharding_parallel_rank()) \
            == (0, 0, 0)

    def snapshot(self, label: str) -> None:
        """Whole values of every parameter (a collective over the tensor-parallel group), and this
        rank's replica description."""
        import numpy as np

        if self.model is None:
            return
        mp = logical_params.groups().get("mp", (None, None))[0]
        config = getattr(logical_params.unwrap(self.model), "config", None)
        values, shapes = {}, {}
        for name, param in logical_params.named_parameters(self.model):
            try:
                for variant, value in logical_params.whole(param, mp, name, config).items():
                    values[name + (VARIANT + variant if variant else "")] = value
            except logical_params.NoSplitAxisError:
                values[name] = logical_params._array(param)
            shapes[name] = {"local": list(param.shape), "split": logical_params.is_split(param)}
        self.replicas[label] = describe_rank(self.model)
        self.replicas[label]["shapes"] = shapes
        self.replicas[label]["aliases"] = logical_params.aliases(self.model)
        if self._writer():
            np.savez(os.path.join(self.directory, f"params.rank{self.rank}.{label}.npz"), **values)

    def finish(self) -> None:
        if self.done or self.steps == 0:
            return
        self.done = True
        self.snapshot("end")
        self.write()

    def write(self) -> None:
        record = {"rank": self.rank, "coords": coordinates(), "losses": self.losses, "steps": self.steps,
                  "replicas": self.replicas, "layout": self.plan.get("layout")}
        with open(os.path.join(self.directory, f"rank{self.rank}.json"), "w") as f:
            json.dump(record, f)


def coordinates() -> dict:
    """This rank's place: ``{"mp": rank, "dp": ..., "sharding": ..., "pp": ..., "mp_size": ...}``."""
    from paddle.distributed import fleet

    try:
        hcg = fleet.get_hybrid_communicate_group()
    except Exception:  # noqa: BLE001
        hcg = None
    if hcg is None:
        return {"mp": 0, "dp": 0, "sharding": 0, "pp": 0, "pp_size": 1, "mp_size": 1}
    return {"mp": hcg.get_model_parallel_rank(), "dp": hcg.get_data_parallel_rank(),
            "sharding": hcg.get_sharding_parallel_rank(), "pp": hcg.get_stage_id(),
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
        names = {"mp": "mp_degree", "pp": "pp_degree", "dp": "dp_degree", "sharding": "sharding_degree"}
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


def _make_distributed_optimizer(original, config):
    @functools.wraps(original)
    def distributed_optimizer(*args, **kwargs):
        optimizer = original(*args, **kwargs)
        step = optimizer.step

        @functools.wraps(step)
        def recorded_step(*a, **k):
            result = step(*a, **k)
            recorder = _recorder(config)
            if not recorder.trainer:
                recorder.step_done()
            return result

        optimizer.step = recorded_step
        return optimizer

    return distributed_optimizer


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
    # every pipeline schedule (the interleaved one has a train_batch of its own; one process a
    # PipelineLayer runs in NoPipelineParallel's)
    # (NoPipelineParallel: Paddle 3.3; 3.2 gives one process the PipelineLayer itself)
    one_process = getattr(pipeline_parallel, "NoPipelineParallel", None)
    for cls in _pipeline_classes(PipelineParallel) + (_pipeline_classes(one_process) if one_process else []):
        patcher.set(cls, "train_batch", _make_train_batch(cls.__dict__["train_batch"], config))
    _hook_trainer(config, patcher)
    return f"recording layout {plan.get('layout')} into {config.verify_dir}"


COMPONENT = Component("verify_record", ("3.2.", "3.3."), "verify_dir", apply)
