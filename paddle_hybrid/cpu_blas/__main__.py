"""``python -m paddle_hybrid.cpu_blas [--alternate | --which]``.

- no argument: print ``export MKL_DEBUG_CPU_TYPE=5`` when new processes on this machine should
  get it (the plugin's own decision), nothing otherwise; ``scripts/env.sh`` evaluates the output.
- ``--alternate``: print the shell lines that put new processes on MKL's second code path on
  this machine (:mod:`.paths`), nothing where none is known; ``scripts/env.sh`` evaluates them
  when ``PADDLE_HYBRID_MKL_PATH=alternate``.
- ``--which``: print which kernels MKL dispatches to in a process of the plugin started with
  this environment (``CPU type 5 (AVX2)``).

The reason or the label goes to stderr."""
import argparse
import os
import sys

from ..config import PluginConfig
from . import _worker_decision, machine, shell_export
from .paths import alternate_path, describe_cpu_type, shell_lines


def _alternate() -> int:
    decision = _worker_decision(None, PluginConfig.from_env())  # a command: its config is the environment's
    path = alternate_path(machine.read_cpu()[0], machine.read_flags(), decision)
    if path is None:
        print("[paddle_hybrid] cpu_blas: no second MKL code path is known for this CPU; one path only",
              file=sys.stderr)
        return 0
    sys.stdout.write(shell_lines(path))
    print(f"[paddle_hybrid] cpu_blas: second code path: {path.label}", file=sys.stderr)
    return 0


def _which() -> int:
    lib, note = machine.mkl_path(os.environ)
    print(describe_cpu_type(machine.mkl_cpu_type(lib)) if lib else f"unknown ({note})")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paddle_hybrid.cpu_blas", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--alternate", action="store_true", help="shell lines for MKL's second code path here")
    mode.add_argument("--which", action="store_true", help="the kernels MKL dispatches to in a plugin process")
    args = parser.parse_args(argv)
    if args.alternate:
        return _alternate()
    if args.which:
        return _which()
    line, reason = shell_export(config=PluginConfig.from_env())
    sys.stdout.write(line)
    print(f"[paddle_hybrid] cpu_blas: {reason}", file=sys.stderr)
    return 0


sys.exit(main())
