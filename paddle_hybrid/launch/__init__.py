"""``python -m paddle_hybrid.launch``: Paddle's launcher, with the plugin in every worker.

Takes exactly the arguments of ``python -m paddle.distributed.launch`` and hands all of them to
it; the only change is the worker's command.  Where Paddle's launcher would run
``python -u train.py ARGS`` it runs ``python -u <this package>/bootstrap.py train.py ARGS``; the
bootstrap imports ``paddle_hybrid`` and then runs ``train.py`` as ``__main__`` with ``sys.argv``
and ``sys.path[0]`` as plain ``python train.py ARGS`` would give them (see :mod:`.bootstrap`).
So an unchanged fleet script trains on CPU with one command::

    python -m paddle_hybrid.launch --nproc_per_node 2 train.py --steps 10

Why a bootstrap script rather than ``sitecustomize``/``PYTHONSTARTUP``: it touches only the
workers of this launch (not every Python started by them, e.g. data-loader or compiler
subprocesses), it cannot shadow a site's own ``sitecustomize``, and it keeps Paddle's
``-u``, log files, etcd elastic restarts and exit codes because Paddle's launcher still starts and watches
every process.

Also, before Paddle's launcher starts:

* ``OMP_NUM_THREADS`` = usable cores // processes per node (at least 1), unless the user set
  it: ``import paddle`` sets it to 1 when unset, so under Paddle's launcher every worker of a
  machine with more cores than workers uses one core for its kernels.  Whether the user set it
  is read before Paddle is imported (:mod:`paddle_hybrid.launch.env_at_start`);
* ``MKL_DEBUG_CPU_TYPE=5`` when :mod:`paddle_hybrid.cpu_blas` decides so for this machine (an
  AMD CPU and a Paddle MKL that honours it) and the user has not set it: in the worker's
  environment from its start, it works even if the script runs a matmul before any import.

On a job of several machines (``--master`` a TCP address that is not loopback), this node's
address for Paddle's launcher (``--host``) and its network interface for gloo
(``GLOO_SOCKET_IFNAME``) are the ones on the route to the master, unless the user gave them
(:mod:`.network`): Paddle's launcher and gloo would take the host name's address otherwise.

With ``--max_restart N`` given explicitly, a failed job is restarted as a whole, up to N times,
each worker told which attempt it is in ``PADDLE_HYBRID_RESTART_COUNT`` (:mod:`.restart`).

When a worker fails, the launcher names the root cause and exits with its code: the worker that
failed first in time on its own, not the -15 of a rank Paddle's launcher stopped nor a peer whose
collective failed because of it (a gloo TIMEOUT, "Connection reset by peer").  After Paddle's
output it prints ``paddle_hybrid.launch: root cause: rank N exited with code C at <time>
(<reason>)`` and the last lines of that rank's log.  Each worker records when and why its script
failed (:mod:`.bootstrap`), the launcher records when each worker process exited
(:mod:`.exit_code`); see ``docs/launch.md``.

A training "script" that is not a ``.py`` file is run by Paddle's launcher as a program, as
it would be anyway; the plugin cannot be put into it, and a warning says so.  Paddle's
launcher has no module mode (``-m pkg.mod``), so neither has this one.
"""
from __future__ import annotations

import os
import sys
import warnings

from .restart import requested_restarts, run_attempts

__all__ = ["BOOTSTRAP", "split_script", "worker_argv", "processes_per_node", "usable_cores", "omp_threads",
           "launch_environment", "environ_as_the_user_set_it", "reach_the_master", "main"]

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap.py")


def _parse_with_paddle(argv: list[str]):
    """Paddle's own parse of the launcher's arguments (its parser reads ``sys.argv``)."""
    from paddle.distributed.launch.context.args_envs import parse_args

    saved = sys.argv
    sys.argv = ["paddle_hybrid.launch", *argv]
    try:
        args, _unknown = parse_args()
    finally:
        sys.argv = saved
    return args


def split_script(argv: list[str], args) -> int:
    """Index in ``argv`` of the training script Paddle's parser found (``args``).  Everything
    after it belongs to the script (argparse ``REMAINDER``)."""
    index = len(argv) - len(args.training_script_args) - 1
    if index < 0 or argv[index] != args.training_script:
        raise RuntimeError(f"paddle_hybrid.launch: could not find the training script {args.training_script!r} "
                           f"in the arguments {argv}; run it with python -m paddle.distributed.launch and "
                           "`import paddle_hybrid` in the script instead.")
    return index


def worker_argv(argv: list[str], args) -> list[str]:
    """The launcher's arguments with the training script replaced by the bootstrap followed by
    the script (a ``.py`` script only: Paddle runs anything else as a program)."""
    index = split_script(argv, args)
    if not args.training_script.endswith(".py"):
        warnings.warn(f"paddle_hybrid.launch: {args.training_script!r} is not a .py file, so Paddle's launcher "
                      "runs it as a program and the plugin cannot be imported into it; add `import paddle_hybrid` "
                      "to the Python script it starts.", RuntimeWarning, stacklevel=2)
        return list(argv)
    return [*argv[:index], BOOTSTRAP, *argv[index:]]


def processes_per_node(args, environ) -> int:
    """How many workers Paddle's launcher starts on this node: its rule (``--nproc_per_node``,
    else one per ``--devices`` entry, else one per detected device, 1 on CPU), with its
    ``PADDLE_*`` environment variables overriding the arguments as they do in Paddle."""
    nproc = environ.get("PADDLE_NPROC_PER_NODE") or args.nproc_per_node
    if nproc:
        return int(nproc)
    devices = environ.get("PADDLE_DEVICES") or args.devices
    if devices:
        return len(devices.split(","))
    from paddle.distributed.launch.context.device import Device

    return Device.parse_device().count


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and ``taskset``
    narrow), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def omp_threads(cores: int, processes: int) -> int:
    return max(1, cores // max(1, processes))


def _config(config=None):
    """``config``, else the plugin as installed in this process, else as the environment says."""
    if config is not None:
        return config
    from ..catalog.install import current_config
    from ..config import PluginConfig

    return current_config() or PluginConfig.from_env()


def launch_environment(args, environ, config=None) -> dict[str, str]:
    """Variables to add to the workers' environment (never overriding one already set), under
    ``config`` (default: the plugin as installed in this process, else as the environment says)."""
    out = {}
    if "OMP_NUM_THREADS" not in environ:
        out["OMP_NUM_THREADS"] = str(omp_threads(usable_cores(), processes_per_node(args, environ)))
    from ..cpu_blas import worker_environment

    config = _config(config)
    for key, value in worker_environment(environ, config=config).items():
        out.setdefault(key, value)
    return out


def environ_as_the_user_set_it() -> dict[str, str]:
    """``os.environ`` without the ``OMP_NUM_THREADS=1`` that ``import paddle`` adds when the
    user has not set it (see :mod:`paddle_hybrid.launch.env_at_start`)."""
    from . import env_at_start as _env_at_start

    environ = dict(os.environ)
    if not _env_at_start.PADDLE_WAS_IMPORTED and _env_at_start.OMP_NUM_THREADS is None:
        environ.pop("OMP_NUM_THREADS", None)
    return environ


def start_waiting_workers(argv: list[str]) -> None:
    """At the launcher's first line, before Paddle is imported: start the processes that import
    Paddle for the workers meanwhile (:mod:`.warm_start`), under the environment the workers
    will get (this module's additions included: computed now as :func:`main` computes them later;
    where the two differ the workers start as before)."""
    import types

    from ..config import PluginConfig
    from . import warm_start

    config = PluginConfig.from_env()
    environ = environ_as_the_user_set_it()
    count = warm_start.early_worker_count(argv, environ)
    if count is None or not config.warm_start or not warm_start.cpu_wheel():
        return
    args = types.SimpleNamespace(nproc_per_node=count, devices=None)
    extra = launch_environment(args, environ, config=config)
    warm_start.start_early(count, {**os.environ, **extra}, float(config.timeout))


def reach_the_master(args, environ, config=None) -> tuple[list[str], dict[str, str]]:
    """(arguments for Paddle's launcher, variables for the workers) that make this node reachable
    from the others of a job of several machines: the address and interface on the route to the
    master, where the user gave none (:mod:`.network`; a line on stderr says what was chosen).  A
    node without a route waits for one at most the job's deadline (``PADDLE_HYBRID_TIMEOUT``)."""
    from . import network

    reach = network.reach_master(args, environ, float(_config(config).timeout))
    if reach is None:
        return [], {}
    print(f"paddle_hybrid.launch: {reach.describe()}", file=sys.stderr, flush=True)
    return reach.launcher_arguments(), reach.environment()


def main(argv: list[str] | None = None) -> None:
    """Parse like Paddle; with an explicit ``--max_restart``, run the job in the restart loop
    (:mod:`.restart`); else rewrite the worker command, add this node's address and interface on
    a job of several machines, set the environment, run Paddle's launcher (its ``sys.exit``
    carries the root cause's exit code, see :mod:`.exit_code`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_with_paddle(argv)
    restarts = requested_restarts(argv[:split_script(argv, args)], args, os.environ)
    if restarts is not None:
        log_dir = os.environ.get("PADDLE_LOG_DIR") or args.log_dir
        sys.exit(run_attempts([sys.executable, "-m", "paddle_hybrid.launch", *argv], restarts, log_dir))
    environ = environ_as_the_user_set_it()
    host_arguments, network_environment = reach_the_master(args, environ)
    new_argv = [*host_arguments, *worker_argv(argv, args)]
    os.environ.update({**launch_environment(args, environ), **network_environment})
    from paddle.distributed.launch.main import launch

    from . import warm_start
    from .exit_code import root_cause_exit_code

    sys.argv = [sys.argv[0], *new_argv]
    with warm_start.handing_over(warm_start.POOL), root_cause_exit_code():
        launch()
