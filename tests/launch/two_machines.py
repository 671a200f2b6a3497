"""Two "machines" on one: two network namespaces joined by a veth pair, for the tests of a job of
several machines (``test_several_machines.py``).

Each namespace has its own network stack: its loopback, one end of the pair (10.201.0.1/24 in
``a``, 10.201.0.2/24 in ``b``), its own ports and routes; the host name is the machine's, in both
(it resolves to neither address: Paddle's launcher cannot find the node's address from it).  Not
like two machines: one kernel, one file system and one ``/dev/shm``, no latency of a real network.
Cutting the link is ``ip link set <b's end> down`` inside ``b``.

The names carry this process's id (two test runs at once on one machine, as CI's two lanes, do not
meet); everything made is removed on the way out, the processes started in the namespaces first.
Needs Linux, root and ``ip netns`` (:func:`unavailable` says why not).
"""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess

ADDRESSES = {"a": "10.201.0.1", "b": "10.201.0.2"}
_made = itertools.count()


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if not os.path.exists("/proc/self/ns/net"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "making network namespaces needs the ip command (iproute2)"
    if _ip("netns", "list", check=False).returncode != 0:
        return "this ip command has no netns"
    return None


class TwoMachines:
    """``with TwoMachines() as m:`` two namespaces ``m.names["a"]``, ``m.names["b"]`` joined by a
    veth pair (``m.links``) with :data:`ADDRESSES`; :meth:`start` runs a command inside one."""

    def __init__(self):
        tag = f"{os.getpid()}{next(_made)}"
        self.names = {node: f"ph_{tag}_{node}" for node in "ab"}
        self.links = {node: f"ph{tag}{node}"[-15:] for node in "ab"}  # an interface name has at most 15 chars
        self.processes: list = []

    def __enter__(self):
        try:
            for node in "ab":
                _ip("netns", "add", self.names[node])
            _ip("link", "add", self.links["a"], "type", "veth", "peer", "name", self.links["b"])
            for node in "ab":
                ns, link = self.names[node], self.links[node]
                _ip("link", "set", link, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{ADDRESSES[node]}/24", "dev", link)
                _ip("-n", ns, "link", "set", link, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def start(self, node: str, argv: list, **popen) -> subprocess.Popen:
        """``argv`` run inside namespace ``node``, in a session of its own (stopped on the way out)."""
        process = subprocess.Popen(["ip", "netns", "exec", self.names[node], *argv], start_new_session=True, **popen)
        self.processes.append(process)
        return process

    def set_link(self, node: str, up: bool) -> None:
        """Bring ``node``'s end of the pair up or down (down: that machine's link is cut)."""
        _ip("-n", self.names[node], "link", "set", self.links[node], "up" if up else "down")

    def stop_all(self) -> None:
        """SIGKILL every process inside the two namespaces (all were started by this object or by
        those: the launchers' workers run in sessions of their own) and reap the ones it started."""
        for node in "ab":
            listed = _ip("netns", "pids", self.names[node], check=False).stdout.split()
            for pid in map(int, listed):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def __exit__(self, *exc):
        self.stop_all()
        for node in "ab":  # a namespace's veth end goes with it
            _ip("netns", "delete", self.names[node], check=False)
        _ip("link", "delete", self.links["a"], check=False)  # only if it never left this namespace
        return False
