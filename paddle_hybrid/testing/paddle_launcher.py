"""``python paddle_launcher.py ARGS``: Paddle's own launcher (``python -m paddle.distributed.launch
ARGS``), looking at its workers every 50 ms instead of every second.

:func:`paddle_hybrid.testing.launch` runs stock launches through this file.  Paddle's ``Pod.watch``
sleeps a second between looks at the workers, so a job is reported finished (or failed) on
average half a second after its last worker ended; a test suite that launches a few hundred jobs
pays minutes for it.  Nothing else about the launcher changes, and this file is run as a script
so the launcher's process does not import ``paddle_hybrid`` (a stock launch stays stock): the
same change as ``paddle_hybrid.launch.exit_code._poll_sooner``, written again here because
importing that module would install the plugin in this process.  On a Paddle other than the
versions it was checked on (:data:`VERIFIED_PADDLE`, those of the plugin's launcher), or whose
``Pod.watch`` does not take ``interval``, it runs Paddle's launcher untouched.
"""
import functools
import inspect
import sys

INTERVAL = 0.05  # seconds between the launcher's looks at its workers (Paddle's: 1)
VERIFIED_PADDLE = ("3.2.", "3.3.")


def main() -> None:
    import paddle
    from paddle.distributed.launch.job.pod import Pod
    from paddle.distributed.launch.main import launch

    verified = paddle.__version__.startswith(VERIFIED_PADDLE)
    if verified and "interval" in inspect.signature(Pod.watch).parameters:
        Pod.watch = functools.partialmethod(Pod.watch, interval=INTERVAL)
    sys.argv = ["paddle.distributed.launch", *sys.argv[1:]]
    launch()


if __name__ == "__main__":
    main()
