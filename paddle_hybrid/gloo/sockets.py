"""This process's sockets, found through ``/proc/self/fd`` (Linux): the store tuning of the CPU
support and the testing API's socket listing read them here."""
from __future__ import annotations

import os

__all__ = ["socket_fds"]

_FD_DIR = "/proc/self/fd"


def socket_fds():
    """{socket inode (as /proc writes it, a decimal string): fd} of this process, or None where
    ``/proc/self/fd`` does not exist."""
    if not os.path.isdir(_FD_DIR):
        return None
    found = {}
    for fd in os.listdir(_FD_DIR):
        try:
            target = os.readlink(f"{_FD_DIR}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            found[target[len("socket:["):-1]] = int(fd)
    return found
