"""The address and the network interface from which this node reaches the job's master, for a job
of several machines: Paddle's launcher gets the address (``--host``), gloo the interface
(``GLOO_SOCKET_IFNAME``).

Why: with ``--nnodes 2 --master 10.0.0.1:PORT`` and nothing else, the documented command did not
meet.  Paddle's launcher takes this node's address from its host name
(``gethostbyname(gethostname())``), often ``127.0.0.1`` or an address on no network the other
machine reaches: no node saw itself as the master's, no master started, and both launchers stopped
at ``AssertionError: No container in the pod``.  With ``--host`` given, gloo still chose its
device from the host name as well and its pairs connected to ``127.0.0.1`` ("connect
[127.0.0.1]:...: Connection refused" on one node, a TIMEOUT on the other).

What: when ``--master`` (or ``PADDLE_MASTER``) is a TCP address that is not loopback, the address
is the one the kernel's routing table uses to reach the master: a UDP socket "connected" to it
(no packet is sent) reports that local address (:func:`route_source`); on the master's own node it
is the master's address itself.  The interface is the one holding that address
(:func:`interface_of`).  Several candidates (a machine with ``eth0``, ``ib0``, ``docker0``): the
route's is chosen, as ``ping`` would leave by; to choose another, give it.

A user's choice wins: ``--host`` (or ``POD_IP``) is kept and its interface given to gloo;
``GLOO_SOCKET_IFNAME`` is kept, and the address still follows the route.  Nothing changes for a
master on loopback (every node on this machine), an ``etcd://`` master, or no ``--master``.

A node that has no route to the master yet (its link is down; the launcher of a restart after a
network cut) waits for one, at most ``PADDLE_HYBRID_TIMEOUT``, then stops naming the master and the
fix.  Limits: IPv4 only (Paddle's launcher splits ``host:port`` on ``:``); an address that is not
its interface's first IPv4 address is not matched (gloo itself takes an interface's first), and
gloo keeps its own choice then.

This module imports only the standard library.
"""
from __future__ import annotations

import dataclasses
import errno
import ipaddress
import socket
import struct
import sys
import time

__all__ = ["Reach", "master_address", "route_source", "interface_of", "reach_master", "IFNAME"]

IFNAME = "GLOO_SOCKET_IFNAME"  # read by Paddle's gloo (ProcessGroupGloo, GlooCommContext)
_SIOCGIFADDR = 0x8915  # Linux: an interface's (first) IPv4 address
_NO_ROUTE = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL)
_RETRY_SECONDS = 0.5
_HEAD = "paddle_hybrid.launch:"


@dataclasses.dataclass(frozen=True)
class Reach:
    """How this node reaches the master: ``host`` (this node's address) and ``interface`` (its
    network interface, None when not found), and which of them the user gave."""

    master: str
    host: str
    interface: str | None
    host_given: bool
    interface_given: bool

    def launcher_arguments(self) -> list:
        """Arguments to add for Paddle's launcher (none when the user gave the address)."""
        return [] if self.host_given else ["--host", self.host]

    def environment(self) -> dict:
        """Variables to add to the workers' environment (none when the user set the interface)."""
        return {} if self.interface_given or self.interface is None else {IFNAME: self.interface}

    def describe(self) -> str:
        where = "the master's own address" if self.host == self.master else f"the route to {self.master}"
        parts = [] if self.host_given else [f"Paddle's launcher --host {self.host}"]
        if not self.interface_given:
            parts.append(f"gloo {IFNAME}={self.interface}" if self.interface else
                         f"gloo: no interface of this machine holds {self.host}, so gloo keeps its own "
                         f"choice (set {IFNAME})")
        return (f"this node reaches the master {self.master} from {self.host} "
                f"({self.interface or 'interface unknown'}, {where}): {', '.join(parts)}; "
                f"give --host or {IFNAME} to choose otherwise")


def master_address(master: str | None) -> str | None:
    """The IPv4 address of a TCP ``host:port`` master (a name is resolved), or None: no master, an
    ``etcd://`` one, or a name that does not resolve (Paddle's launcher then reports it)."""
    if not master or "://" in master:
        return None
    host = master.rsplit(":", 1)[0].strip("[]")
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return None


def route_source(address: str) -> str:
    """This machine's address on the kernel's route to ``address`` (raises ``OSError`` when there
    is none).  A UDP ``connect`` only chooses the route: nothing is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return probe.getsockname()[0]


def _ipv4_of(name: str) -> str | None:
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on that interface
            return None
    return socket.inet_ntoa(answer[20:24])


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface whose IPv4 address is ``address``, or None
    (none has it, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    for _index, name in socket.if_nameindex():
        if _ipv4_of(name) == address:
            return name
    return None


def _given(argv_args, environ) -> tuple:
    """(master, host, interface) as Paddle's launcher will read them: its environment variables
    override its arguments (``PADDLE_MASTER``, ``POD_IP``)."""
    master = environ.get("PADDLE_MASTER") or getattr(argv_args, "master", None)
    host = environ.get("POD_IP") or getattr(argv_args, "host", None)
    return master, host, environ.get(IFNAME) or None


def _wait_for_route(master: str, timeout: float, log) -> str:
    """Phase: the route's source address, waiting up to ``timeout`` seconds while there is none."""
    give_up = time.monotonic() + timeout
    said = False
    while True:
        try:
            return route_source(master)
        except OSError as exc:
            if exc.errno not in _NO_ROUTE:
                raise
            if time.monotonic() >= give_up:
                raise SystemExit(
                    f"{_HEAD} no route from this node to the master {master} after {timeout:g} s "
                    f"(PADDLE_HYBRID_TIMEOUT): {exc.strerror}. Check the --master address and this node's "
                    f"network (is its interface up?), or give --host and {IFNAME} yourself.") from exc
            if not said:
                log(f"no route from this node to the master {master} yet ({exc.strerror}: is its link down?); "
                    f"waiting for one, at most {timeout:g} s (PADDLE_HYBRID_TIMEOUT)")
                said = True
            time.sleep(_RETRY_SECONDS)


def reach_master(args, environ, timeout: float, log=None) -> Reach | None:
    """Phases: read the user's choices; resolve the master (none, loopback or ``etcd://``: None,
    nothing changes); this node's address (the user's, else the route's, waiting for a route at
    most ``timeout`` seconds); its interface (the user's, else the one holding the address).
    None also when the user gave both."""
    log = log or (lambda line: print(f"{_HEAD} {line}", file=sys.stderr, flush=True))
    master, host, interface = _given(args, environ)
    if host and interface:
        return None
    address = master_address(master)
    if address is None or ipaddress.ip_address(address).is_loopback:
        return None
    chosen = host or _wait_for_route(address, timeout, log)
    return Reach(master=address, host=chosen, interface=interface or interface_of(chosen),
                 host_given=bool(host), interface_given=bool(interface))
