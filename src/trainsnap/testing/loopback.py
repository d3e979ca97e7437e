"""A ``TCPStore`` server for tests and benchmarks on one machine, listening on IPv4.

torch's store server looks up the name of every peer that connects, on its one thread. On the
dual-stack socket it opens by itself a loopback peer is ``::ffff:127.0.0.1``, which the hosts
file does not name, so the lookup goes to DNS -- and on a machine whose resolver does not
answer, the whole store stops for the resolver's timeout (5 s) at every connection. An IPv4
peer ``127.0.0.1`` is named by the hosts file at once.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any


def master_store(
    port: int = 0, timeout: timedelta = timedelta(seconds=300), host: str = "127.0.0.1"
) -> Any:
    """A master ``TCPStore`` on ``port`` (0: a free one; ``.port`` says which) of ``host``
    (``0.0.0.0``: every IPv4 address, 127.0.0.2 and up too), not waiting for workers."""
    from torch._C._distributed_c10d import TCPStore

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(4096)
    return TCPStore(
        "127.0.0.1",
        listener.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
        master_listen_fd=listener.detach(),
    )


def client_store(port: int, timeout: timedelta = timedelta(seconds=300)) -> Any:
    """A client of the store on ``port`` of 127.0.0.1."""
    from torch._C._distributed_c10d import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
