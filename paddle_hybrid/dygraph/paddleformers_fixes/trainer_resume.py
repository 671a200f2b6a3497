"""The Trainer resumes from its newest *complete* checkpoint, by itself after a restart.

PaddleFormers 1.2.0's defects on the way back from a lost rank (every device):

* ``train(resume_from_checkpoint=True)`` on a fresh ``output_dir`` raises "No valid checkpoint
  found"; with a checkpoint there, ``prepare_resume_from_checkpoint`` resolves the path into a
  local variable and ``train`` passes the bool on to ``_load_flex_checkpoint`` (``TypeError``);
  ``--resume_from_checkpoint True`` on the command line is the string ``"True"``
  (``FileNotFoundError: 'True/model_state'``).
* ``get_last_checkpoint`` returns the newest ``checkpoint-N`` without asking whether every rank
  finished writing it (its marker exists only under ``FLAG_LLM_PDC``); after a death in the middle
  of a save every restart fails on "Found no metadata files".
* an unchanged script restarted by ``python -m paddle_hybrid.launch --max_restart`` starts again at
  step 1 and overwrites its checkpoints.

What this fix does:

* **Marks a checkpoint complete only when every rank wrote it.**  ``_save_checkpoint`` is wrapped:
  global rank 0 writes ``checkpoint-N/.paddle_hybrid_saving`` and every rank passes a barrier
  before anything is written; after PaddleFormers' save every rank passes a barrier again and
  rank 0 replaces the marker with ``.paddle_hybrid_complete``.  A folder with the first marker and
  not the second was cut by a death (it is cleared before the same step is saved again: its
  metadata file would stop that save); one with neither was written without the plugin and
  counts as complete, as it always did.
* **Resolves what to resume from** (``train`` wrapped, :func:`resolve`): ``True`` and the strings
  ``"true"``/``"True"``/``"yes"``/``"1"`` mean the newest complete checkpoint in ``output_dir``, or
  a fresh start with a log line when there is none; ``"false"``/``"none"``/``""`` mean none; a
  path is kept, and an incomplete one refused naming it.  In a restart
  (``PADDLE_HYBRID_RESTART_COUNT`` > 0, set by the launcher) a run given nothing resumes from the
  newest complete checkpoint; a first start given nothing starts fresh, as before.
* ``get_last_checkpoint`` (which scripts call to pick the path themselves) skips incomplete
  checkpoints, with a log line.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import sys

__all__ = ["SAVING", "COMPLETE", "RESTART_COUNT", "is_complete", "newest_complete", "resolve", "apply"]

SAVING = ".paddle_hybrid_saving"
COMPLETE = ".paddle_hybrid_complete"
RESTART_COUNT = "PADDLE_HYBRID_RESTART_COUNT"  # set in every worker by python -m paddle_hybrid.launch
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_TRUE, _FALSE = {"true", "yes", "1"}, {"false", "no", "0", "none", ""}


def _say(message: str) -> None:
    print(f"[paddle_hybrid] {message}", file=sys.stderr, flush=True)


def is_complete(folder: str) -> bool:
    """Every rank finished writing ``folder``: not marked as being saved, or marked complete."""
    return os.path.exists(os.path.join(folder, COMPLETE)) or not os.path.exists(os.path.join(folder, SAVING))


def newest_complete(output_dir: str, say=_say) -> str | None:
    """The ``checkpoint-N`` of ``output_dir`` with the largest N that is complete; the
    incomplete ones passed over are named."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return None
    found = sorted(((int(m.group(1)), n) for n in names if (m := _CHECKPOINT.match(n))
                    and os.path.isdir(os.path.join(output_dir, n))), reverse=True)
    for _, name in found:
        folder = os.path.join(output_dir, name)
        if is_complete(folder):
            return folder
        say(f"skipping {folder}: incomplete (a rank stopped while it was being saved)")
    return None


def resolve(value, output_dir: str, restart_count: int, say=_say):
    """What ``Trainer.train`` should resume from (a path or None) for the ``value`` it was given."""
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        value = value.strip().lower() in _TRUE
    if value is False:
        value = None
    if value is None and restart_count > 0:
        found = newest_complete(output_dir, say)
        say(f"restart {restart_count}: " + (f"resuming from {found}" if found else
                                             f"no complete checkpoint in {output_dir}; training from the start"))
        return found
    if value is True:
        found = newest_complete(output_dir, say)
        if found is None:
            say(f"resume_from_checkpoint=True: no complete checkpoint in {output_dir}; training from the start")
        return found
    if isinstance(value, str) and not is_complete(value):
        raise ValueError(f"paddle_hybrid: resume_from_checkpoint={value!r} is incomplete: a rank stopped while it was "
                         f"being saved ({SAVING} without {COMPLETE}). Resume from an earlier checkpoint, or pass True "
                         "for the newest complete one.")
    return value


def _rank_and_barrier():
    import paddle.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return 0, (lambda: None)
    return dist.get_rank(), dist.barrier


def _make_save_checkpoint(original, prefix: str):
    @functools.wraps(original)
    def _save_checkpoint(self, model, metrics=None):
        if getattr(self.args, "enable_zero_cost_checkpoint", False):
            return original(self, model, metrics)
        folder = os.path.join(self.args.output_dir, f"{prefix}-{self.state.global_step}")
        rank, barrier = _rank_and_barrier()
        # 1. marked as being saved before any rank writes into it
        if rank == 0:
            if not is_complete(folder):
                # cut by a death: its files (a metadata file among them) would stop this save
                _say(f"clearing {folder}: incomplete, saved again now")
                shutil.rmtree(folder)
            os.makedirs(folder, exist_ok=True)
            if os.path.exists(os.path.join(folder, COMPLETE)):  # a folder saved again at the same step
                os.remove(os.path.join(folder, COMPLETE))
            with open(os.path.join(folder, SAVING), "w") as f:
                f.write("being saved; replaced by the completion marker once every rank has written\n")
        barrier()
        # 2. PaddleFormers' save
        result = original(self, model, metrics)
        # 3. complete once every rank is past its save
        barrier()
        if rank == 0 and os.path.isdir(folder):
            with open(os.path.join(folder, COMPLETE), "w") as f:
                f.write("every rank wrote its part\n")
            os.remove(os.path.join(folder, SAVING))
        return result

    return _save_checkpoint


def _make_train(original):
    @functools.wraps(original)
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        restart = int(os.environ.get(RESTART_COUNT, "0") or 0)
        path = resolve(resume_from_checkpoint, self.args.output_dir, restart)
        return original(self, path, *args, **kwargs)

    return train


def _make_get_last_checkpoint(original):
    @functools.wraps(original)
    def get_last_checkpoint(folder, *args, **kwargs):
        found = original(folder, *args, **kwargs)
        if found is not None and not is_complete(found):
            _say(f"get_last_checkpoint: skipping {found}: incomplete")
            return newest_complete(folder)
        return found

    return get_last_checkpoint


def fix(patcher, trainer_module) -> None:
    """Phases: check what is wrapped, then wrap ``Trainer.train``, ``Trainer._save_checkpoint`` and
    ``get_last_checkpoint`` where PaddleFormers' modules hold it."""
    import importlib

    trainer_class = patcher.require(trainer_module, "Trainer", trainer_module.__name__)
    patcher.check_params(trainer_class.train, ["self", "resume_from_checkpoint", "ignore_keys_for_eval"],
                         "Trainer.train")
    patcher.check_params(trainer_class._save_checkpoint, ["self", "model", "metrics"], "Trainer._save_checkpoint")
    utils = importlib.import_module("paddleformers.trainer.trainer_utils")
    prefix = patcher.require(trainer_module, "PREFIX_CHECKPOINT_DIR", trainer_module.__name__)
    original_last = patcher.require(utils, "get_last_checkpoint", "paddleformers.trainer.trainer_utils")
    patcher.set(trainer_class, "train", _make_train(trainer_class.train))
    patcher.set(trainer_class, "_save_checkpoint", _make_save_checkpoint(trainer_class._save_checkpoint, prefix))
    wrapped_last = _make_get_last_checkpoint(original_last)
    for name in ("paddleformers.trainer.trainer_utils", "paddleformers.trainer.trainer", "paddleformers.trainer"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "get_last_checkpoint", None) is original_last:
            patcher.set(module, "get_last_checkpoint", wrapped_last)
