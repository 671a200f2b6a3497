"""``--enable_auto_parallel 1``: the trained weights empty after training, and no save works.

PaddleFormers 1.2 wraps every auto-parallel model in Paddle's fused FSDP (``fully_shard``,
``trainer.py``), which keeps each parameter's value only as this rank's piece of a fused buffer and
frees the parameter; the optimizer updates the pieces and nothing writes them back (see
:mod:`paddle_hybrid.common.fused_fsdp`).  Seen with Paddle 3.3.1 on CPU, DP2 and sharding 2 (the
frees are unconditional, so on every device): after ``trainer.train()`` every parameter on every
rank has no storage, ``param.numpy()`` a zero-size array, and ``trainer.save_model()``, a
checkpoint at ``--save_steps``, ``model.save_pretrained()`` and ``paddle.save(model.state_dict())``
all stop (``DistTensor is not defined yet when local_dims...``); the optimizer state is keyed by the
fused buffers (``fuse_params_0_moment1_0``), which no checkpoint key names.

Fixes, on the auto-parallel path when a fused-FSDP context exists:

- ``Trainer.train`` ends with the trained values gathered into the parameters (collective, every
  rank): the model reads, evaluates and saves as a model trained in one process does.  The next
  forward binds them to FSDP's buffers again; a value set on a parameter after ``train()`` is not
  seen by a later ``train()``.
- ``Trainer._save`` (``save_model`` and every checkpoint) runs with the parameters gathered (the
  whole model on each rank for the time of the save, as PaddleFormers' stage-3 sharding saves) and
  frees them again when they were free before.  The model's entries are the same keys and shapes as
  a one-process save.
- ``Trainer._save_flex_optimizer_state`` writes the fused optimizer state per parameter under the
  keys of the fleet path (``<key>.moment1_0``, ``<key>.beta1_pow_acc_0``, ...), each rank only its
  own piece (flattened ranges: nothing gathered).  So a checkpoint of the auto path resumes in one
  process, on the fleet path or in another auto-parallel layout, as flex checkpoints do.
- ``Trainer._load_flex_checkpoint`` loads the model into the gathered parameters and writes them
  into this rank's pieces; the optimizer state into the fused buffers' accumulators (made first:
  Paddle makes them at the first step).

Anything the fixes cannot carry (master weights of multi-precision training) is an error naming it.
"""
from __future__ import annotations

import functools
import inspect
import os

from ...common import fused_fsdp
from ...registry.patching import PatchSignatureError

__all__ = ["fix"]


def _fsdp_of(trainer):
    """The fused-FSDP context of an auto-parallel Trainer, or None (fleet path, no FSDP)."""
    if not getattr(trainer.args, "enable_auto_parallel", False):
        return None
    return fused_fsdp.context()


def _make_fully_shard(stock):
    """PaddleFormers' ``fully_shard`` (its own global): the parameters whole again right after the
    wrapping, so the resume that follows in ``train`` (``model.sharded_state_dict()``, a load into it)
    has tensors to read and write; the training loop's start puts them into the pieces."""
    @functools.wraps(stock)
    def fully_shard(model, *args, **kwargs):
        wrapped = stock(model, *args, **kwargs)
        fsdp = fused_fsdp.context()
        if fsdp is not None and fsdp.model is model:
            fused_fsdp.gather_parameters(fsdp)
        return wrapped

    return fully_shard


def _make_training_loop(stock, names):
    signature = inspect.signature(stock)

    @functools.wraps(stock)
    def _inner_training_loop(self, *args, **kwargs):
        fsdp = _fsdp_of(self)
        if fsdp is not None and fused_fsdp.parameters_are_whole(fsdp):
            resume = signature.bind(self, *args, **kwargs).arguments.get("resume_from_checkpoint")
            _enter_training(self, fsdp, resume, names)
        return stock(self, *args, **kwargs)

    return _inner_training_loop


def _enter_training(trainer, fsdp, resume, names) -> None:
    """Phases: the optimizer state of a Hugging-Face-format resume (whose weights ``train`` just
    loaded into the whole parameters); the parameters' values into this rank's pieces (what was
    loaded or set since they were gathered); the parameters freed, as FSDP keeps them."""
    args = trainer.args
    if resume and args.convert_from_hf and not args.ignore_load_lr_and_optim:
        optimizer_dir = os.path.join(resume, names.OPTIMIZER_STATE_DIC)
        if not os.path.isdir(optimizer_dir):
            raise fused_fsdp.FusedFSDPStateError(
                f"--resume_from_checkpoint {resume}: no optimizer state ({names.OPTIMIZER_STATE_DIC}/) beside the "
                "weights; an auto-parallel resume would restart Adam's moments from zero and train differently "
                "from the run it continues (PaddleFormers' auto-parallel checkpoints in Hugging Face format hold the "
                "weights only; paddle_hybrid adds the optimizer state to those it saves). Resume from a checkpoint "
                "saved with paddle_hybrid, or pass --ignore_load_lr_and_optim true to start the moments afresh.")
        _load_optimizer(trainer, fsdp, resume, names)
    fused_fsdp.scatter_parameters(fsdp)
    fused_fsdp.release_parameters(fsdp)


def _make_train(stock):
    @functools.wraps(stock)
    def train(self, *args, **kwargs):
        result = stock(self, *args, **kwargs)
        fsdp = _fsdp_of(self)
        if fsdp is not None:
            fused_fsdp.gather_parameters(fsdp)
        return result

    return train


def _make_save(stock):
    @functools.wraps(stock)
    def _save(self, output_dir=None, state_dict=None, merge_tensor_parallel=False, last_fc_to_hf=False):
        fsdp = _fsdp_of(self)
        if fsdp is None:
            return stock(self, output_dir, state_dict, merge_tensor_parallel, last_fc_to_hf)
        with fused_fsdp.whole_parameters(fsdp):
            result = stock(self, output_dir, state_dict, merge_tensor_parallel, last_fc_to_hf)
            # A checkpoint (_save_checkpoint hands its state_dict) in Hugging Face format holds the weights
            # only; the optimizer state goes beside them so that a resume continues the run.
            if state_dict is not None and self.args.save_to_hf:
                self._save_flex_optimizer_state(output_dir or self.args.output_dir)
        return result

    return _save


def _make_save_optimizer(stock, names):
    @functools.wraps(stock)
    def _save_flex_optimizer_state(self, output_dir):
        fsdp = _fsdp_of(self)
        if fsdp is None:
            return stock(self, output_dir)
        import paddle.distributed as dist

        with fused_fsdp.whole_parameters(fsdp):
            model_state = self.model.sharded_state_dict()
        states = fused_fsdp.optimizer_state_shards(fsdp, self.optimizer, model_state)
        replicas = self.args.replicate_saved_into_local
        dist.save_state_dict(states, os.path.join(output_dir, names.OPTIMIZER_STATE_DIC), save_replicas=replicas)
        # No master weights (float32 training); the directory is written as the stock save writes it, so a
        # resume (which reads its metadata) finds it.
        dist.save_state_dict({}, os.path.join(output_dir, names.MASTER_WEIGHT_DIC), save_replicas=replicas)
        with open(os.path.join(output_dir, f"saved_signal_{dist.get_rank()}"), "w") as f:
            f.write("1")

    return _save_flex_optimizer_state


def _make_load(stock, names):
    @functools.wraps(stock)
    def _load_flex_checkpoint(self, resume_from_checkpoint):
        fsdp = _fsdp_of(self)
        # Hugging Face weights only (load_from_hf): Paddle's own load into the parameters, whole since
        # fully_shard; the training loop's start writes them into the pieces.
        if fsdp is None or self.args.load_from_hf:
            return stock(self, resume_from_checkpoint)
        _load(self, fsdp, resume_from_checkpoint, names)

    return _load_flex_checkpoint


def _load(trainer, fsdp, path: str, names) -> None:
    """Phases: the model into the gathered parameters and back into the pieces; the optimizer state
    into the fused accumulators and the scheduler."""
    import paddle.distributed as dist

    args = trainer.args
    with fused_fsdp.whole_parameters(fsdp, write_back=True):
        model_state = trainer.model.sharded_state_dict()
        dist.load_state_dict(model_state, os.path.join(path, names.MODEL_STATE_DIC), aoa_config=args.aoa_config,
                             offload=args.load_via_cpu)
    if not args.ignore_load_lr_and_optim:
        _load_optimizer(trainer, fsdp, path, names)


def _load_optimizer(trainer, fsdp, path: str, names) -> None:
    import paddle.distributed as dist

    args = trainer.args
    fused_fsdp.ensure_optimizer_state(fsdp, trainer.optimizer)
    with fused_fsdp.whole_parameters(fsdp):
        model_state = trainer.model.sharded_state_dict()
    targets = fused_fsdp.optimizer_state_shards(fsdp, trainer.optimizer, model_state, copy=True)
    dist.load_state_dict(targets, os.path.join(path, names.OPTIMIZER_STATE_DIC), aoa_config=args.aoa_config,
                         offload=args.load_via_cpu)
    fused_fsdp.write_optimizer_state(fsdp, trainer.optimizer, model_state, targets)
    trainer._load_scheduler(path)


def fix(patcher, trainer_module) -> None:
    trainer_cls = patcher.require(trainer_module, "Trainer", "paddleformers.trainer.trainer")
    for name in ("OPTIMIZER_STATE_DIC", "MASTER_WEIGHT_DIC", "MODEL_STATE_DIC"):
        patcher.require(trainer_module, name, "paddleformers.trainer.trainer")
    train = patcher.require(trainer_cls, "train", "paddleformers Trainer")
    save = patcher.require(trainer_cls, "_save", "paddleformers Trainer")
    patcher.check_params(save, ["self", "output_dir", "state_dict", "merge_tensor_parallel", "last_fc_to_hf"],
                         "Trainer._save")
    save_optimizer = patcher.require(trainer_cls, "_save_flex_optimizer_state", "paddleformers Trainer")
    patcher.check_params(save_optimizer, ["self", "output_dir"], "Trainer._save_flex_optimizer_state")
    load = patcher.require(trainer_cls, "_load_flex_checkpoint", "paddleformers Trainer")
    patcher.check_params(load, ["self", "resume_from_checkpoint"], "Trainer._load_flex_checkpoint")
    patcher.require(trainer_cls, "_load_scheduler", "paddleformers Trainer")
    loop = patcher.require(trainer_cls, "_inner_training_loop", "paddleformers Trainer")
    if "resume_from_checkpoint" not in inspect.signature(loop).parameters:
        raise PatchSignatureError(
            "paddleformers_fixes: Trainer._inner_training_loop has no parameter resume_from_checkpoint; unexpected "
            "PaddleFormers. Set PADDLE_HYBRID_PADDLEFORMERS_FIXES=0 to run without the fixes.")
    fully_shard = patcher.require(trainer_module, "fully_shard", "paddleformers.trainer.trainer")

    patcher.set(trainer_module, "fully_shard", _make_fully_shard(fully_shard))
    patcher.set(trainer_cls, "_inner_training_loop", _make_training_loop(loop, trainer_module))

    patcher.set(trainer_cls, "train", _make_train(train))
    patcher.set(trainer_cls, "_save", _make_save(save))
    patcher.set(trainer_cls, "_save_flex_optimizer_state", _make_save_optimizer(save_optimizer, trainer_module))
    patcher.set(trainer_cls, "_load_flex_checkpoint", _make_load(load, trainer_module))
