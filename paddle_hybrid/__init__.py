"""paddle_hybrid: faster, easier hybrid-parallel training for PaddlePaddle fleet.

``import paddle_hybrid`` before ``fleet.init`` loads the plugin's custom ops and installs its
components once (listed in :mod:`paddle_hybrid.catalog`, each declared with
:mod:`paddle_hybrid.registry`); :func:`uninstall` undoes them.  Import paths that moved keep
working with a ``DeprecationWarning`` (:mod:`paddle_hybrid._moved`).
"""
from .launch import env_at_start  # noqa: F401  (first: records the environment before Paddle changes it)


def _is_the_launcher_process() -> bool:
    """True while ``python -m paddle_hybrid.launch`` imports this package to run its launcher:
    that process starts the workers and runs no model (each worker installs the plugin itself),
    so it skips the install (a third of a second of a 2-process job's start-up).  ``sys.argv[0]``
    is ``"-m"`` only while Python looks for the main module, so a script started with ``-m``
    that imports this package later installs as usual."""
    import sys

    argv = getattr(sys, "orig_argv", [])
    return sys.argv[:1] == ["-m"] and "-m" in argv and argv[argv.index("-m") + 1:][:1] == ["paddle_hybrid.launch"]


def _launcher_arguments() -> list:
    """The arguments after ``-m paddle_hybrid.launch`` (``sys.argv`` is not set yet)."""
    import sys

    argv = sys.orig_argv
    return argv[argv.index("-m") + 2:]


if _is_the_launcher_process():  # before anything imports Paddle: workers import theirs meanwhile
    from .launch import start_waiting_workers

    start_waiting_workers(_launcher_arguments())

from . import _moved
from . import ops
from .config import PluginConfig
from .dygraph import timeline
from .dygraph.cuda_graph import CUDAGraphedLayer, GraphPool
from .dygraph.grad_buckets import BucketLayoutError, GradBuckets, GradSyncError
from .catalog.install import (InstallError, current_config, install, install_component, installed_components,
                               patches, report, uninstall, uninstall_component)
from .static import fused_allreduce, send_wait

_moved.install_finder()

__version__ = "0.1.0"

__all__ = [
    "ops",
    "fused_allreduce",
    "send_wait",
    "timeline",
    "PluginConfig",
    "install",
    "uninstall",
    "installed_components",
    "install_component",
    "uninstall_component",
    "report",
    "patches",
    "InstallError",
    "current_config",
    "__version__",
    "CUDAGraphedLayer",
    "GraphPool",
    "GradBuckets",
    "BucketLayoutError",
    "GradSyncError",
]


if not _is_the_launcher_process():
    install()
