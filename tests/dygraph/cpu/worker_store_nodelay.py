"""Worker: after ``init_parallel_env``, report ``TCP_NODELAY`` of every connection of this process to
or from the job's store (its port is ``PADDLE_MASTER``'s), and of the store's listening socket.

Run through paddle_hybrid.testing.launch on 2 ranks; ``PADDLE_HYBRID_STORE_NODELAY`` decides."""
import os
import socket

import paddle
import paddle.distributed as dist

import paddle_hybrid  # noqa: F401  (installs the plugin)
from paddle_hybrid.gloo.sockets import socket_fds
from paddle_hybrid.testing import save_result


def store_sockets(port: int) -> list:
    """(role, TCP_NODELAY) of each TCP socket whose local or far port is the store's."""
    found = []
    for fd in socket_fds().values():
        sock = socket.socket(fileno=fd)
        try:
            if sock.family != socket.AF_INET or sock.type != socket.SOCK_STREAM:
                continue
            local = sock.getsockname()[1]
            try:
                peer = sock.getpeername()[1]
            except OSError:  # not connected: a listening socket
                peer = None
            role = ("listening" if peer is None else "accepted") if local == port else (
                "client" if peer == port else None)
            if role:
                found.append((role, sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))
        finally:
            sock.detach()
    return sorted(found)


def main():
    paddle.set_device("cpu")
    dist.init_parallel_env()
    port = int(os.environ["PADDLE_MASTER"].rsplit(":", 1)[1])
    save_result({"rank": dist.get_rank(), "sockets": store_sockets(port)})


if __name__ == "__main__":
    main()
