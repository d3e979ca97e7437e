"""Whether a peer's process has ended, told at once where it can be, without the heartbeat.

A rank killed outright (SIGKILL, the out-of-memory killer) runs no handler and sends nothing: its
peers see only that its heartbeat stops, and must wait the heartbeat timeout before they may call
it dead (a slow or stalled rank looks the same for a while). Where the waiting rank can see the
peer's process, no wait is needed: each rank publishes what identifies its process (host, PID
namespace, PID, start time) once a session, and a waiting rank on the same host and in the same
PID namespace checks that the process still exists -- a dead process is named at the next
liveness scan. A peer on another host is found by its heartbeat as before (or at once by the
peers whose connection to it broke, see :mod:`trainsnap.protocol.data_group`).

Linux only (``/proc``); elsewhere every peer is left to the heartbeat. Cost: one key per rank a
session, one ``stat`` of ``/proc`` per awaited peer on this host per scan.
"""

from __future__ import annotations

import functools
import os
import socket

__all__ = ["ended", "identity"]


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot: with the PID, a process's
    identity; a PID is reused, the pair is not), or None when there is no such live process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (command) ": state, ppid, ...
    if len(fields) < 20 or fields[0] in ("Z", "X"):  # a zombie has ended
        return None
    return fields[19]


def _namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@functools.cache
def _here() -> tuple[str, str]:
    return socket.gethostname(), _namespace()


def identity() -> str:
    """This process's identity as its peers check it (empty where it cannot be checked)."""
    host, namespace = _here()
    started = _start_time(os.getpid())
    if not namespace or started is None:
        return ""
    return f"{host}\n{namespace}\n{os.getpid()}\n{started}"


def ended(peer: str) -> bool:
    """Whether the process of identity ``peer`` is known to have ended: it was on this host and
    in this PID namespace, and is gone (or its PID now names another process). False when it
    cannot be told (another host, another namespace, no identity)."""
    parts = peer.split("\n")
    if len(parts) != 4 or (parts[0], parts[1]) != _here() or not parts[1]:
        return False
    return _start_time(int(parts[2])) != parts[3]
