"""``--nnodes N``: a layout's ranks split over N launchers on this host, one per "node", started
as a cluster starts them.

Each launcher is ``python -m paddle_hybrid.launch --nnodes N --rank I --master 127.0.0.1:PORT
--host 127.0.0.<I+1> --nproc_per_node K SCRIPT ...`` (K = the layout's ranks / N; node I holds
global ranks I*K .. I*K+K-1, as Paddle's launcher numbers a node's ranks after the nodes before it).
Paddle's launchers meet at the master's key-value server (the first to bind PORT serves it), and
each worker gets what it would get on a node of a cluster: ``PADDLE_NNODES`` N, ``PADDLE_LOCAL_SIZE``
K, ``PADDLE_LOCAL_RANK`` within its launcher, its endpoint on its node's own address.  So:

* every collective group whose ranks sit in two launchers, and the job's store (rank 0's TCP store
  at ``PADDLE_MASTER``), are reached through sockets, as across nodes;
* the plugin's same-host shared-memory paths (:mod:`paddle_hybrid.gloo.local_ring`,
  :mod:`~paddle_hybrid.gloo.local_p2p`) decide by ``eligible_job``: with ``PADDLE_NNODES`` above 1
  and fewer local ranks than ranks they are off in every process of the job (not only across
  launchers), so none spans launchers; every collective goes through gloo;
* each node has an address of its own (127.0.0.1, 127.0.0.2, ...: all of 127/8 is loopback on
  Linux), so code that tells nodes apart by the endpoints' hosts sees N hosts.

What differs from separate hosts: one kernel, one clock and one ``/dev/shm`` (a defect that
needs a file or segment another node cannot see is not caught); gloo's pairs all bind 127.0.0.1
(gloo takes an interface's first address, so the per-node addresses reach the endpoints and the
launchers' exchange, not gloo's sockets); ``socket.gethostname()`` is one name for all; loopback has
no latency, loss or bandwidth limit, so timing-dependent failures are as unlikely as in one launcher.

When a launcher fails the others are stopped (a peer's collective would otherwise wait out its
deadline) and the root cause is the launchers' own (:mod:`paddle_hybrid.launch.exit_code`), chosen
across them by the same rule: a failure not caused by a peer (a gloo timeout, a reset connection)
before one that is, then the earliest.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

from ..launch.exit_code import is_collateral
from .layouts import LayoutError

__all__ = ["check", "free_port", "launcher_commands", "run", "root_cause_line", "GRACE_SECONDS"]

GRACE_SECONDS = 5.0  # after a launcher fails: the others may report their own failure before being stopped
_POLL_SECONDS = 0.1
_ROOT_CAUSE = re.compile(r"paddle_hybrid\.launch: root cause: rank (\d+) (?:exited|hung; the job exits) with code "
                         r"(-?\d+) at (\S+ \S+) \((.*)\)$", re.MULTILINE)


def check(layouts: list, nnodes: int) -> None:
    """Every layout's ranks split evenly over ``nnodes`` launchers (:class:`LayoutError` if not)."""
    if nnodes < 1:
        raise LayoutError(f"--nnodes {nnodes}: give 1 or more")
    for layout in layouts:
        if layout.nprocs % nnodes:
            raise LayoutError(f"layout {layout.name} has {layout.nprocs} ranks: they do not split evenly over "
                              f"--nnodes {nnodes}; give a number of nodes that divides {layout.nprocs}")


def free_port() -> int:
    """A TCP port free on this host now (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_commands(script: str, args: list, nprocs: int, nnodes: int, port: int, log_dir: str) -> list:
    """One ``paddle_hybrid.launch`` command per node; node I logs into ``log_dir/nodeI``."""
    per_node = nprocs // nnodes
    return [[sys.executable, "-m", "paddle_hybrid.launch", "--nnodes", str(nnodes), "--rank", str(node),
             "--master", f"127.0.0.1:{port}", "--host", f"127.0.0.{node + 1}", "--nproc_per_node", str(per_node),
             "--log_dir", os.path.join(log_dir, f"node{node}"), script, *args] for node in range(nnodes)]


def _stop(proc: subprocess.Popen) -> None:
    """Stop a launcher and its workers (its own process group: it was started in a new session)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def root_cause_line(outputs: dict) -> str | None:
    """The root cause across launchers (``{node: output}`` of those that failed): the launchers'
    own lines, a failure not caused by a peer first, then the earliest; None when none reported
    one."""
    found = []
    for node, text in outputs.items():
        for match in _ROOT_CAUSE.finditer(text):
            rank, code, when, reason = match.groups()
            found.append((is_collateral(reason), when, node, f"node {node}: rank {rank} exited with code {code} at "
                                                             f"{when} ({reason})"))
    return min(found)[3] if found else None


def run(script: str, args: list, nprocs: int, nnodes: int, directory: str, env: dict, timeout: float):
    """Run the job over ``nnodes`` launchers; ``(ok, output)``: every launcher's command and output,
    and on a failure the root cause across them first."""
    port = free_port()
    commands = launcher_commands(script, args, nprocs, nnodes, port, os.path.join(directory, "logs"))
    outs = [open(os.path.join(directory, f"launcher{node}.txt"), "w+") for node in range(nnodes)]
    procs = [subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
             for cmd, out in zip(commands, outs)]
    deadline, failed_at, note = time.monotonic() + timeout, None, ""
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > GRACE_SECONDS:
                note = f"a launcher failed: the others stopped after {GRACE_SECONDS:g} s\n"
                break
            if now > deadline:
                note = f"did not finish within {timeout:.0f} s: every launcher stopped\n"
                break
            time.sleep(_POLL_SECONDS)
    finally:
        for proc in procs:
            _stop(proc)
    texts = {}
    for node, out in enumerate(outs):
        out.seek(0)
        texts[node] = out.read()
        out.close()
    codes = [p.returncode for p in procs]
    ok = not note and all(c == 0 for c in codes)
    body = "".join(f"--- launcher of node {node} (exit {codes[node]}): {' '.join(commands[node])}\n{texts[node]}"
                   for node in range(nnodes))
    if ok:
        return True, body
    return False, body + _failure_summary(note, {node: texts[node] for node, c in enumerate(codes) if c != 0}, nnodes)


def _failure_summary(note: str, failed: dict, nnodes: int) -> str:
    """What ends a failed run's output (the part a verifier's report shows): the root cause's
    launcher block (the end of its rank's log), then why the run ended and the root cause."""
    cause = root_cause_line(failed)
    if cause is None:
        return f"\n{note}no launcher named a root cause (see each launcher's output above)\n"
    node = int(cause.split(":", 1)[0].split()[1])
    text = failed[node]
    block = text[text.find("paddle_hybrid.launch: root cause"):]
    return f"\n{block[-1000:]}\n{note}root cause across the {nnodes} launchers: {cause}\n"
