"""What kind of training script a tool is given, and the flags it takes degrees by: shared by
``python -m paddle_hybrid.verify`` and ``python -m paddle_hybrid.dryrun``, read from the script's
source without running it.

* ``trainer``: PaddleFormers' ``TrainingArguments`` in the script (the Trainer's own flags:
  ``--tensor_model_parallel_size``, ``--pipeline_model_parallel_size``, ``--sharding_parallel_size``...);
* ``flags``: the script declares its degree flags in a module-level literal
  ``PADDLE_HYBRID_LAYOUT_FLAGS = {"mp": "--mp", "pp": "--pp", ...}`` (``examples/gpt_pp.py``);
* ``fleet``: anything else.
"""
from __future__ import annotations

import ast
import re

__all__ = ["script_flags", "kind_of", "flag_value", "argument_defaults", "script_value", "trainer_flags",
           "TRAINER_VP_FLAG"]

# PaddleFormers 1.2's TrainingArguments has no virtual-pipeline flag; its models read the configuration's
# ``virtual_pipeline_model_parallel_size``.  A Trainer script that declares an argument of that name (as
# ``examples/paddleformers_trainer.py`` does, setting the configuration's field) takes vp through it.
TRAINER_VP_FLAG = "--virtual_pipeline_model_parallel_size"


def script_flags(source: str) -> dict | None:
    """The script's ``PADDLE_HYBRID_LAYOUT_FLAGS`` dict (a literal), or None."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PADDLE_HYBRID_LAYOUT_FLAGS"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def argument_defaults(source: str, flags) -> dict:
    """``{flag: default}`` of every ``add_argument(flag, ..., default=<literal>)`` call in the source, for
    the flags asked: a tool checks a script's sizes against its own defaults without running it."""
    wanted, found = set(flags), {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        for keyword in node.keywords:
            if keyword.arg == "default":
                try:
                    value = ast.literal_eval(keyword.value)
                except ValueError:
                    continue  # not a literal: unknown until the script runs
                for name in names:
                    if name in wanted:
                        found[name] = value
    return found


def script_value(args: list, flags: dict | None, key: str, defaults: dict | None = None):
    """The value the script takes for ``key`` of its ``PADDLE_HYBRID_LAYOUT_FLAGS``: given in ``args``, else
    its parser's default (``defaults``: :func:`argument_defaults`), else None (no such flag, or no literal
    default)."""
    flag = (flags or {}).get(key)
    if flag is None:
        return None
    return flag_value(args, flag, (defaults or {}).get(flag))


def trainer_flags(source: str) -> dict:
    """The degree flags a Trainer script declares beyond ``TrainingArguments``' own: ``{"vp": ...}`` when
    its source names ``virtual_pipeline_model_parallel_size`` as an argument (a dataclass field or a flag)."""
    declares = re.search(r"^\s*virtual_pipeline_model_parallel_size\s*:", source, re.M) or TRAINER_VP_FLAG in source
    return {"vp": TRAINER_VP_FLAG} if declares else {}


def kind_of(source: str) -> str:
    if script_flags(source) is not None:
        return "flags"
    if "TrainingArguments" in source:
        return "trainer"
    return "fleet"


def flag_value(args: list, flag: str, default=None):
    """The value given to ``flag`` in ``args`` (``--flag v`` or ``--flag=v``; the last one wins), or ``default``."""
    found = default
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found
