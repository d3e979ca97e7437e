"""Shared save decisions: the coordinator's answer, read by every rank at decision steps only.

Decisions that depend on a clock, a measurement or a signal must be the same on every rank, or
one rank would start a save the others never join. The coordinator takes them at *decision
steps* (a sequence it announces ahead, each decision naming the next) and publishes each on the
control plane; every other step costs no store operation. Cost: O(1) store operations per
decision step and rank, none between them.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from datetime import timedelta

from trainsnap.protocol.control_plane import Comm, PeerLost, StoreComm


class Decisions:
    """Shared decisions on the control plane. Decision step ``c`` (a count of ``step()``
    calls) has the key ``decide/<c>``: the kinds of save every rank makes
    there and the next decision step. One process: decided at the step itself, no store."""

    KEEP = 16
    """Decision keys the coordinator leaves in the store (every rank is long past older ones)."""

    def __init__(self, comm: Comm, seq: int, decision_seconds: float) -> None:
        self.comm = comm
        self.store = comm.store if isinstance(comm, StoreComm) else None
        self.prefix = f"trainsnap/manager-{seq}"
        self.calls = 0
        self.next = 0
        """The call count of the next decision step."""
        self.decision_steps: deque[int] = deque(maxlen=self.KEEP)
        """Call counts of the decision steps so far (bounded: the newest KEEP)."""
        self.agreed = 0
        """Calls of :meth:`agree` so far."""
        self.requested = False
        self.preempt = False
        """(coordinator) Signalled since its last decision step."""

    def take(self, shared: Callable[[], set[str]], signalled: bool, window: int) -> set[str]:
        """The shared kinds of save at this call. ``shared()`` evaluates the shared policies
        (called by the coordinator at decision steps only), ``signalled``: a preemption signal
        reached this rank since its last call, ``window``: (coordinator) calls to the next
        decision step. Store operations: none between decision steps, save a signalled rank's
        one request; at a decision step one read (others) or three or four (coordinator)."""
        call, self.calls = self.calls, self.calls + 1
        if self.store is None:
            return shared() | ({"preempt"} if signalled else set())
        if signalled and self.comm.is_coordinator:
            self.preempt = True
        elif signalled and not self.requested:
            self.store.set(f"{self.prefix}/preempt", b"1")
            self.requested = True
        if call < self.next:
            return set()
        if self.comm.is_coordinator:
            kinds = shared()
            request = f"{self.prefix}/preempt"
            if self.preempt or self.store.check([request]):
                kinds.add("preempt")
                self.preempt = False
            nxt = call + max(1, window)
            self.store.set(f"{self.prefix}/decide/{call}", json.dumps([sorted(kinds), nxt]))
            if len(self.decision_steps) == self.KEEP:
                self.store.delete_key(f"{self.prefix}/decide/{self.decision_steps[0]}")
        else:
            doc = json.loads(self._read(f"{self.prefix}/decide/{call}", f"decision of call {call}"))
            kinds, nxt = set(doc[0]), int(doc[1])
        self.next = nxt
        self.decision_steps.append(call)
        return kinds

    def agree(self, go: bool) -> bool:
        """(all ranks, at the same call) The coordinator's ``go`` on every rank: whether a
        save that may be skipped when the saver is busy runs (a rank's own view of its saver
        may differ). One store write (coordinator) or read (others); none in one process."""
        if self.store is None:
            return go
        n, self.agreed = self.agreed, self.agreed + 1
        key = f"{self.prefix}/go/{n}"
        if self.comm.is_coordinator:
            self.store.set(key, b"1" if go else b"0")
            if n >= self.KEEP:
                self.store.delete_key(f"{self.prefix}/go/{n - self.KEEP}")
            return go
        return self._read(key, f"go/skip answer {n}") == b"1"

    def _read(self, key: str, what: str) -> bytes:
        """(others) The coordinator's value under ``key``, waited for at most the control
        plane's exchange timeout (``ManagerOptions.timeout``), never the store's own (which can
        be half an hour): a coordinator partitioned away or hung fails this rank's step with
        :class:`PeerLost` naming it, as any exchange would."""
        assert isinstance(self.comm, StoreComm) and self.store is not None
        bound = self.comm.timeouts.exchange
        try:
            self.store.wait([key], timedelta(seconds=bound))
        except Exception as e:  # the store's wait raises on its timeout (or a broken link)
            coordinator = self.comm.coordinator
            why = f"published no {what} within {bound:.0f} s ({type(e).__name__}: {e})"
            raise PeerLost(
                f"the coordinator (rank {coordinator}) {why}; if it is alive but slow, raise "
                "ManagerOptions(timeout=...)",
                {coordinator: why},
            ) from e
        return bytes(self.store.get(key))
