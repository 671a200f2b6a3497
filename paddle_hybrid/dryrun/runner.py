"""One rank of the world, run alone: a process whose environment is the one Paddle's launcher gives
that rank, in the plugin's fake world (:mod:`paddle_hybrid.gloo.fake_world`), with the probe
(:mod:`paddle_hybrid.dygraph.dryrun_probe`) recording what it holds and moves.

The process runs the script through the launcher's bootstrap (the plugin imported first, the script
as ``__main__``).  Nothing in it waits on a peer: every group answers at once.  A wait the fake world
cannot answer (a key in the job's store no peer will set) ends at ``timeout`` seconds with the
plugin's error; the whole process is given ``timeout`` plus the script's own time limit
(``wall_limit``) and is stopped after it, named.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

__all__ = ["RankRun", "run_rank", "rank_environment"]

BOOTSTRAP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "bootstrap.py")


class RankRun:
    """What one rank's process left: exit code, wall seconds, peak resident bytes, its probe record,
    the tail of its output."""

    def __init__(self, rank, returncode, wall_s, max_rss_bytes, probe, tail, timed_out=False):
        self.rank, self.returncode, self.wall_s, self.max_rss_bytes = rank, returncode, wall_s, max_rss_bytes
        self.probe, self.tail, self.timed_out = probe, tail, timed_out


def rank_environment(rank: int, world_size: int, nproc: int, world_file: str, probe_dir: str, timeout: float) -> dict:
    """The environment of ``rank`` as Paddle's launcher would set it (endpoints are never dialled in the
    fake world), plus the plugin's dry-run settings."""
    node = rank // nproc
    endpoints = ",".join(f"10.{(i // nproc) // 256}.{(i // nproc) % 256}.1:{6170 + i % nproc}" for i in range(world_size))
    env = dict(os.environ)
    env.update({
        "PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(world_size), "PADDLE_RANK_IN_NODE": str(rank % nproc),
        "PADDLE_LOCAL_SIZE": str(nproc), "PADDLE_NNODES": str(world_size // nproc),
        "PADDLE_TRAINER_ENDPOINTS": endpoints, "PADDLE_CURRENT_ENDPOINT": endpoints.split(",")[rank],
        "PADDLE_MASTER": endpoints.split(",")[0], "PADDLE_DISTRI_BACKEND": "gloo", "PADDLE_NODE_RANK": str(node),
        # the launcher's pod name: dist.to_static calls fleet.init when it sees one, as in the real job
        "POD_NAME": f"dryrun-node{node}",
        "PADDLE_HYBRID_FAKE_WORLD": world_file, "PADDLE_HYBRID_DRYRUN_PROBE": probe_dir,
        # an all-to-all without peers cannot say what a gate's experts would receive: a balanced step is measured
        "PADDLE_HYBRID_BALANCED_ROUTING": "1",
        # the start-up agreement compares every rank's settings through the store: no peer answers here
        "PADDLE_HYBRID_AGREEMENT": "0",
        "PADDLE_HYBRID_TIMEOUT": str(timeout),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    })
    return env


def run_rank(rank: int, world_size: int, nproc: int, script: str, args: list, work: str, timeout: float,
             wall_limit: float, log) -> RankRun:
    """Phases: the world file; the process (its output to ``<work>/rank<R>.log``, progress lines to
    ``log``); its record."""
    world_file = os.path.join(work, f"world.{rank}.json")
    with open(world_file, "w") as f:
        json.dump({"rank": rank, "world_size": world_size, "out": os.path.join(work, "records"),
                   "replay": os.path.join(work, "records")}, f)
    probe_dir = os.path.join(work, "probes")
    env = rank_environment(rank, world_size, nproc, world_file, probe_dir, timeout)
    out_path = os.path.join(work, f"rank{rank}.log")
    start = time.time()
    timed_out = False
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-u", BOOTSTRAP, script, *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        deadline = start + wall_limit
        status = None
        rusage = None
        while status is None:
            pid, raw, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status = raw
                break
            if time.time() > deadline:
                proc.kill()
                timed_out = True
                _, status, rusage = os.wait4(proc.pid, 0)
                break
            _progress(out_path, log)
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
    _progress(out_path, log)
    probe = None
    probe_file = os.path.join(probe_dir, f"probe.{rank}.json")
    if os.path.isfile(probe_file):
        with open(probe_file) as f:
            probe = json.load(f)
    with open(out_path, errors="replace") as f:
        tail = f.read()[-4000:]
    max_rss = int(rusage.ru_maxrss) * 1024 if rusage is not None else 0  # Linux: kilobytes
    return RankRun(rank, proc.returncode, time.time() - start, max_rss, probe, tail, timed_out)


_SEEN = {}


def _progress(path: str, log) -> None:
    """The dry run's own lines from a rank's output, each once."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    seen = _SEEN.get(path, 0)
    for line in lines[seen:]:
        if line.startswith("[paddle_hybrid.dryrun]"):
            log(line)
    _SEEN[path] = len(lines)

