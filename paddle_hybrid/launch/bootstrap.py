"""What each worker of ``python -m paddle_hybrid.launch`` runs: ``bootstrap.py SCRIPT ARGS``.

Imports ``paddle_hybrid`` (which installs the plugin), then runs SCRIPT as plain
``python SCRIPT ARGS`` would: ``__name__ == "__main__"``, ``__file__`` = SCRIPT,
``sys.argv == [SCRIPT, *ARGS]``, the script's directory first on ``sys.path``.  ``runpy``
puts the script's module in ``sys.modules["__main__"]`` while it runs, so objects defined in it
pickle as they do under plain Python.  An exception or ``sys.exit`` in the script ends the
process as it would without the bootstrap (exit status 1 or the given code).

Run as a file, not as part of the package: this directory, which Python put first on
``sys.path``, is replaced by the script's.
"""
import os
import runpy
import sys


def _import_plugin() -> None:
    """Import the ``paddle_hybrid`` this file belongs to (also when it is not installed, e.g.
    run from a checkout), without leaving its parent directory on ``sys.path``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, root)
    try:
        import paddle_hybrid  # noqa: F401  (installs the plugin before the script's first line)
    finally:
        sys.path.remove(root)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m paddle_hybrid.launch [launcher arguments] script.py [script arguments]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    # Python puts the directory of the (symlink-resolved) script first on sys.path.
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    _import_plugin()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
