"""The exit code of ``python -m paddle_hybrid.launch``: the code of the worker that failed first.

When a worker fails, Paddle's launcher stops the others (SIGTERM) and then exits with the code
of the first worker *in rank order* whose code is not 0 (``Pod.exit_code``).  A lower rank that
was still running when it was stopped has -15, so the launcher exits 241 (-15 & 0xff) and the
script's own code (``sys.exit(7)``, 1 for an exception) is lost; whether it is lost depends on
whether the lower ranks had already finished, a race.  Like torchrun's "root cause", this
launcher exits with the code of the lowest rank among the workers that had failed on their own,
i.e. had already exited with a non-zero code when Paddle's launcher began to stop the pod.  When
none had (the user pressed Ctrl-C, a peer node failed), Paddle's rule stands.

Two methods of Paddle's ``Pod`` are wrapped, in the launcher's process only, through a
:class:`~paddle_hybrid.registry.patching.Patcher` that :func:`root_cause_exit_code` reverts on the way out:

* ``stop``: at the first stop after a deploy, record the codes of the workers that have exited
  with a non-zero code (before any signal is sent);
* ``deploy``: forget the record (an elastic restart deploys the pod again);

and the ``exit_code`` property returns the first recorded code, else Paddle's.
"""
from __future__ import annotations

import contextlib
import warnings

from ..registry.patching import Patcher, describe_versions, version_supported

__all__ = ["VERIFIED_PADDLE", "root_cause_exit_code", "own_failures"]

# Paddle versions whose Pod.stop / Pod.deploy / Pod.exit_code were read and tested.
VERIFIED_PADDLE = ("3.2.", "3.3.")

_RECORD = "_ph_own_failures"


def own_failures(pod) -> list[int]:
    """Exit codes of the pod's workers that have failed (exited, code not 0), in rank order;
    Paddle's own ``Pod.failed_container`` says which (a worker never started is not one)."""
    return [container.exit_code for container in pod.failed_container()]


def _install(patcher: Patcher, pod_class) -> None:
    original_stop = patcher.require(pod_class, "stop", "paddle.distributed.launch.job.pod.Pod")
    original_deploy = patcher.require(pod_class, "deploy", "paddle.distributed.launch.job.pod.Pod")
    original_exit_code = pod_class.__dict__.get("exit_code")
    if not isinstance(original_exit_code, property):
        raise TypeError("paddle.distributed.launch.job.pod.Pod.exit_code is not a property")

    def stop(self, *args, **kwargs):
        # Only the first stop after a deploy sees the workers as they ended on their own.
        if getattr(self, _RECORD, None) is None:
            setattr(self, _RECORD, own_failures(self))
        return original_stop(self, *args, **kwargs)

    def deploy(self, *args, **kwargs):
        setattr(self, _RECORD, None)
        return original_deploy(self, *args, **kwargs)

    def exit_code(self):
        recorded = getattr(self, _RECORD, None)
        if recorded:
            return recorded[0]
        return original_exit_code.fget(self)

    patcher.set(pod_class, "stop", stop)
    patcher.set(pod_class, "deploy", deploy)
    patcher.set(pod_class, "exit_code", property(exit_code))


@contextlib.contextmanager
def root_cause_exit_code():
    """While inside, Paddle's launcher in this process exits with the first failing worker's
    code (see the module docstring).  On a Paddle version this was not verified on it warns
    and leaves Paddle's rule."""
    import paddle
    from paddle.distributed.launch.job.pod import Pod

    patcher = Patcher("paddle_hybrid.launch", "python -m paddle.distributed.launch")
    if version_supported(paddle.__version__, VERIFIED_PADDLE):
        _install(patcher, Pod)
    else:
        warnings.warn(f"paddle_hybrid.launch: Paddle {paddle.__version__} is not one the exit-code rule was verified "
                      f"on ({describe_versions(VERIFIED_PADDLE)}); the launcher exits with Paddle's code (that of "
                      "the lowest rank with a non-zero code, which may be one the launcher stopped).",
                      RuntimeWarning, stacklevel=3)
    try:
        yield
    finally:
        patcher.revert()
