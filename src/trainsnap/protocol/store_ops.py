"""The store operations of the control plane (:mod:`trainsnap.protocol.control_plane`): the
store clients a process keeps between sessions, and reads that answer for many keys in few
operations."""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from typing import Any

from trainsnap import tunables
from trainsnap.protocol.planner import PlanMemory

log = logging.getLogger(__name__)

ABSENT = b"\x00absent"
"""``compare_set``'s answer for a key that does not exist."""

_JOBS: dict[tuple[int, int], tuple[Any, Job]] = {}
CLIENTS_LOCK = threading.Lock()


class Job:
    """What this process keeps for one job (one store) between sessions: its idle store
    clients, by kind (see ``StoreComm._kind``), what it remembers of save plans, and the
    process group its checkpoint data travels over."""

    def __init__(self) -> None:
        self.clients: dict[str, list[Any]] = {}
        self.plans = PlanMemory()
        self._data_group: tuple[Any, Any] | None = None
        """(default process group, the checkpoint-data group made for it)."""

    def data_group(self) -> Any:
        """The gloo group for checkpoint data (never the training group: no collective of the
        training loop can be in flight on it), made for the current default process group the
        first time it is asked for. Collective that first time: every rank of the job calls it
        at the same point."""
        import torch.distributed as dist

        default = dist.distributed_c10d._get_default_group()
        if self._data_group is None or self._data_group[0] is not default:
            seconds = float(tunables.get().heartbeat_seconds)
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
            self._data_group = (default, group)
        return self._data_group[1]

    def forget_data_group(self) -> None:
        """Drop the checkpoint-data group (after a failed exchange: a member may be gone); the
        next :meth:`data_group` makes a fresh one."""
        self._data_group = None


def job_of(store: Any) -> Job:
    """This process's :class:`Job` of ``store``. Keyed by process, so that a forked child never
    shares its parent's connections, and holding ``store`` itself, so that its id is not reused
    for another store."""
    key = (os.getpid(), id(store))
    with CLIENTS_LOCK:
        entry = _JOBS.get(key)
        if entry is None or entry[0] is not store:
            entry = _JOBS[key] = (store, Job())
        return entry[1]


def set_timeout(store: Any, seconds: float) -> None:
    try:
        store.set_timeout(timedelta(seconds=seconds))
    except Exception:  # a store without timeouts: nothing to bound
        log.debug("store %r takes no timeout", store, exc_info=True)


def present(store: Any, keys: list[str]) -> list[bool]:
    """Which of ``keys`` exist, by bisection with ``check`` (which answers for all the keys it
    is given): one operation when all exist, about 2 m log2(n / m) when m of n do not."""
    if not keys:
        return []
    if store.check(keys):
        return [True] * len(keys)
    if len(keys) == 1:
        return [False]
    half = len(keys) // 2
    return present(store, keys[:half]) + present(store, keys[half:])


def read_all(store: Any, keys: list[str]) -> list[bytes]:
    """The values of ``keys``, ``ABSENT`` for a key that does not exist, in few operations."""
    if len(keys) == 1:  # compare_set reads one key without creating it
        return [bytes(store.compare_set(keys[0], ABSENT, ABSENT))]
    here = present(store, keys)
    found = iter(store.multi_get([k for k, there in zip(keys, here, strict=True) if there]))
    return [bytes(next(found)) if there else ABSENT for there in here]
