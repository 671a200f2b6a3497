"""The TCP sockets this process listens on, read from ``/proc`` (Linux): what a test checks to
see that the plugin opened no port of its own."""
from __future__ import annotations

import ipaddress
import os

from ..gloo.sockets import socket_fds

__all__ = ["listening_sockets"]

_LISTEN = "0A"  # the state column of /proc/net/tcp


def _address(hex_address: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc prints each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.IPv6Address(words) if v6 else ipaddress.IPv4Address(words))


def listening_sockets() -> list:
    """``(address, port)`` of every TCP socket of this process in state LISTEN, sorted;
    ``address`` is ``"0.0.0.0"`` or ``"::"`` for a socket bound to every interface."""
    inodes = set(socket_fds() or {})
    found = []
    for table, v6 in (("/proc/self/net/tcp", False), ("/proc/self/net/tcp6", True)):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == _LISTEN and fields[9] in inodes:
                    address, port = fields[1].rsplit(":", 1)
                    found.append((_address(address, v6), int(port, 16)))
    return sorted(found)
