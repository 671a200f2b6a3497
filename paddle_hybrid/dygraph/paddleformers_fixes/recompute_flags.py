"""The Trainer's recompute flags reach the model.

PaddleFormers 1.2's ``TrainingArguments`` take ``--recompute_granularity``, ``--recompute_method``
and ``--recompute_num_layers``; the Trainer only sets ``enable_recompute`` on layers that have
the attribute (``trainer.py``), while its LLaMA decides per forward from its *config*
(``config.recompute_granularity == "full" and config.recompute_method == "uniform" and
config.recompute_num_layers == 1``, ``llama/modeling.py``), which the flags never reach.  So the
flags are accepted and no layer is ever recomputed: a run that fits in memory on a small model
and runs out of it at scale, on every device.  (PaddleFormers' own run scripts copy the flags into
the config themselves; a plain ``Trainer`` script does not.)

Fix: at ``Trainer.__init__``, each of the three the user set is written into the model's config
when the config has that field and leaves it unset (None); a config value the user gave differently
is an error naming both.
"""
from __future__ import annotations

__all__ = ["FLAGS", "carry"]

FLAGS = ("recompute_granularity", "recompute_method", "recompute_num_layers")


def carry(args, model) -> list:
    """Write the recompute flags of ``args`` into ``model.config``; return the names written."""
    config = getattr(model, "config", None)
    if config is None or getattr(args, "recompute_granularity", None) is None:
        return []
    written = []
    for name in FLAGS:
        given = getattr(args, name, None)
        if given is None or not hasattr(config, name):
            continue
        current = getattr(config, name)
        if current is None:
            setattr(config, name, given)
            written.append(name)
        elif current != given:
            raise ValueError(f"--{name} {given!r} but the model's config says {name}={current!r}; give one of them "
                             f"(paddle_hybrid.paddleformers_fixes.recompute_flags)")
    return written
