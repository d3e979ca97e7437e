"""The CheckpointManager: when to save, what to keep, how to come back.

Every rank creates the manager and calls it at the same points of the loop. Decisions are taken
once and shared, so ranks never disagree about whether a step saves:

* policies that every rank evaluates alike (``Every(steps=N)``) are evaluated locally;
* decisions that depend on a clock, a measurement or a signal (``Every(seconds=T)``,
  ``YoungDaly``, a predicate, SIGTERM/SIGUSR1 on any rank) are taken at step ``s`` by the rank
  that sees them and published on the control plane for step ``s + 1``. Every rank checks for
  the current step's decision at each ``step()``; since ranks of a training job are kept within
  one step of each other by the training's own collectives, a decision for ``s + 1`` published
  during step ``s`` is seen by every rank at step ``s + 1``.

After each committed save the coordinator applies the retention policies (the newest snapshot
and saves in flight are never deleted; deleting removes the marker first) and collects objects
no snapshot references, with a grace period for saves in flight.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from . import commit, gc, lease
from .asyncsave import AsyncSaver, SaveHandle
from .comm import Comm, StoreComm
from .errors import (
    CommitFailedError,
    CorruptError,
    IncompleteError,
    InvalidArgumentError,
    TrainsnapError,
)
from .manifest import Manifest
from .policy import Candidate, StepInfo, as_retention, as_save_policies, to_delete
from .snapshot import Root, SnapshotInfo, _comm, load, save_options
from .storage import open_storage

log = logging.getLogger("trainsnap.manager")

_manager_seq = itertools.count(1)


class CheckpointManager:
    """Saves on a schedule, keeps what the retention policies say, restores the newest good
    snapshot, and saves on preemption.

    Args:
        root: where the run's snapshots live (path or URL).
        interval: when to save: ``ts.Every(steps=N)``, ``ts.Every(seconds=T)``,
            ``ts.YoungDaly(mtbf=...)``, a predicate ``f(StepInfo) -> bool``, or a list (any).
        retention: what to keep: ``ts.KeepLast(n)``, ``ts.KeepEvery(steps)``,
            ``ts.KeepBest(metric, mode, n)``, or a list (kept if any keeps it). None keeps all.
            Snapshots saved with ``tags`` are always kept.
        async_save: return from a save once the state is staged (the default).
        max_in_flight: saves in flight at most (a new one waits, or is skipped with
            ``skip_if_busy``).
        staging_budget: most host bytes the staging pool may hold.
        gc_grace: seconds an unreferenced object is left alone (a save in flight may be about to
            reference it); should exceed the longest save.
        preemption_signals: signals that request a save at the next step (handlers chain to
            the previous ones); ``()`` installs none.
        coordinator, timeout, storage_options: as for ``ts.save``.
    """

    def __init__(
        self,
        root: Root,
        *,
        interval: Any = None,
        retention: Any = None,
        async_save: bool = True,
        max_in_flight: int = 1,
        skip_if_busy: bool = False,
        staging_budget: int | None = None,
        gc_grace: float = 3600.0,
        preemption_signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1),
        coordinator: int = 0,
        timeout: float | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.storage = open_storage(root, **dict(storage_options or {}))
        self.policies = as_save_policies(interval)
        self.retention = as_retention(retention)
        self.async_save = async_save
        self.gc_grace = gc_grace
        self._coordinator, self._timeout = coordinator, timeout
        self.comm: Comm = _comm(coordinator, timeout)
        self.saver = AsyncSaver(
            max_in_flight=max_in_flight, skip_if_busy=skip_if_busy, staging_budget=staging_budget
        )
        self._decisions = _Decisions(self.comm, next(_manager_seq))
        self._preempt_flag = threading.Event()
        self.preempted = False
        self._closed = False
        self._last_save_step: int | None = None
        self._last_save_time: float | None = None
        self._last_step_time: float | None = None
        self._save_costs: deque[float] = deque(maxlen=20)
        self._step_times: deque[float] = deque(maxlen=200)
        self._handles: list[SaveHandle] = []
        self._lease: lease.Lease | None = None
        self._newest_committed: str | None = None
        self.observed_mtbf: float | None = None
        if self.comm.is_coordinator:
            self._start()
        self._previous_handlers = self._install_signals(preemption_signals)

    # -- start, restore -------------------------------------------------------------------

    def _start(self) -> None:
        self._lease = lease.Lease.take(self.storage)
        evs = lease.events(self.storage)
        crashed = lease.last_generation_crashed(evs, self._lease.generation)
        if crashed is not None:
            lease.record(
                self.storage, self._lease.generation, "crash_detected",
                previous_generation=crashed["generation"], last_event=crashed["kind"],
                last_time=crashed["time"],
            )  # fmt: skip
            log.warning(
                "the previous job on %s (generation %s) ended without closing: crash after its "
                "%r event", self.storage.url, crashed["generation"], crashed["kind"],
            )  # fmt: skip
        lease.record(self.storage, self._lease.generation, "start")
        self.observed_mtbf, _ = lease.observed_mtbf(lease.events(self.storage))

    @property
    def generation(self) -> int | None:
        return self._lease.generation if self._lease else None

    def restore(
        self, state: Any, level: str = "strict", *, allow_downgrade: bool = False
    ) -> SnapshotInfo | None:
        """Restore the newest committed snapshot that verifies; fall back to older ones when it
        is damaged (saying why). None when the root holds none."""
        ids = self._candidates()
        for sid in ids:
            try:
                info = load(
                    state, self.storage, snapshot=sid, level=level,
                    allow_downgrade=allow_downgrade, coordinator=self._coordinator,
                    timeout=self._timeout,
                )  # fmt: skip
            except TrainsnapError as e:
                if not self._agree_fallback(e):
                    raise
                log.warning("snapshot %s cannot be restored, trying an older one: %s", sid, e)
                if self.comm.is_coordinator and self._lease is not None:
                    lease.record(
                        self.storage, self._lease.generation, "restore_failed",
                        snapshot=sid, error=str(e)[:500],
                    )  # fmt: skip
                continue
            self._last_save_step, self._last_save_time = info.step, time.monotonic()
            if self.comm.is_coordinator and self._lease is not None:
                lease.record(
                    self.storage, self._lease.generation, "restore", snapshot=info.id,
                    step=info.step, level=info.level,
                )  # fmt: skip
            return info
        if ids:
            raise TrainsnapError(
                f"none of the {len(ids)} committed snapshots of {self.storage.url} could be "
                "restored; see the warnings above for each one's damage"
            )
        return None

    def _agree_fallback(self, e: TrainsnapError) -> bool:
        """Fall back to an older snapshot only if every rank's failure is damage to this one
        (corrupt or incomplete data, another rank's failure); a state that does not fit, a level
        the snapshot cannot give or a newer format would not fit an older snapshot either, and
        silently resuming from further back would lose progress. Every rank decides alike."""
        damage = isinstance(e, CorruptError | IncompleteError | CommitFailedError)
        session = self.comm.session("fallback")
        try:
            votes = session.gather("vote", damage)
            verdict = None if votes is None else all(votes)
            return bool(session.broadcast("verdict", verdict))
        finally:
            session.close()

    def _candidates(self) -> list[str]:
        """Newest first, decided by the coordinator so every rank tries the same sequence."""
        session = self.comm.session("restore")
        try:
            ids = None
            if self.comm.is_coordinator:
                ids = [c.snapshot_id for c in reversed(commit.list_committed(self.storage))]
            return list(session.broadcast("candidates", ids))
        finally:
            session.close()

    # -- the loop ---------------------------------------------------------------------------

    def step(self, step: int, state: Any, metrics: Mapping[str, float] | None = None) -> bool:
        """Call after each optimizer step. Saves when a policy (or a preemption) says so;
        returns True if it saved. After a preemption save, :attr:`preempted` is True."""
        self._check_open()
        now = time.monotonic()
        if self._last_step_time is not None:
            self._step_times.append(now - self._last_step_time)
        self._last_step_time = now
        info = StepInfo(
            step=step, now=now, last_save_step=self._last_save_step,
            last_save_time=self._last_save_time, save_costs=tuple(self._save_costs),
            step_times=tuple(self._step_times), mtbf_observed=self.observed_mtbf,
        )  # fmt: skip
        local = any(p.should_save(info) for p in self.policies if not p.shared)
        # Publish decisions for the next step: the coordinator's shared policies, and a
        # preemption signalled on this rank.
        at = step if self.comm.world_size == 1 else step + 1
        if self.comm.is_coordinator and any(p.should_save(info) for p in self.policies if p.shared):
            self._decisions.publish(at, "policy")
        if self._preempt_flag.is_set():
            self._preempt_flag.clear()
            self._decisions.publish(at, "preempt")
        reason = self._decisions.take(step)
        if not (local or reason):
            return False
        handle = self.save(step, state, metrics=metrics)
        if reason == "preempt":
            self.preempted = True
            if isinstance(handle, SaveHandle):
                handle.wait()  # a preempted job must not exit before its save is durable
            if self.comm.is_coordinator and self._lease is not None:
                lease.record(self.storage, self._lease.generation, "preempt", step=step)
        return handle is not None

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, float] | None = None,
        tags: Sequence[str] = (),
    ) -> SaveHandle | SnapshotInfo | None:
        """Save now (asynchronously if the manager is). ``tags`` pin the snapshot."""
        self._check_open()
        meta: dict[str, Any] = {}
        if metrics:
            meta["metrics"] = {str(k): float(v) for k, v in metrics.items()}
        if tags:
            meta["tags"] = [str(t) for t in tags]
        tree, opts = save_options(state, step=step, meta=meta)
        opts.fence = self._lease.check if self._lease is not None else None
        opts.on_commit = self._after_commit if self.comm.is_coordinator else None
        t0 = time.perf_counter()
        result: SaveHandle | SnapshotInfo | None
        if self.async_save:
            result = self.saver.save(tree, self.storage, opts, self.comm)
            if result is not None:
                self._handles.append(result)
                self._save_costs.append(result.pause)
        else:
            from .collective import run_save

            r = run_save(tree, self.storage, opts, self.comm)
            self._save_costs.append(time.perf_counter() - t0)
            result = (
                SnapshotInfo.from_manifest(r.manifest, self.storage.url)
                if r.manifest is not None
                else SnapshotInfo.from_summary(
                    r.outcome.snapshot_id, r.outcome.manifest_summary, self.storage.url
                )
            )
        if result is not None:
            self._last_save_step, self._last_save_time = step, time.monotonic()
        return result

    def _after_commit(self, manifest: Manifest) -> None:
        """(coordinator, after each commit) record, apply retention, collect."""
        assert self._lease is not None
        self._newest_committed = manifest.snapshot_id
        lease.record(
            self.storage, self._lease.generation, "save", snapshot=manifest.snapshot_id,
            step=manifest.step, nbytes=manifest.nbytes,
        )  # fmt: skip
        self.apply_retention()
        if self.saver.in_flight() <= 1:  # only this save, finishing now: nothing else in flight
            gc.collect(self.storage, grace=self.gc_grace)

    def apply_retention(self) -> list[str]:
        """Delete the committed snapshots no retention policy keeps (never the newest)."""
        if not self.retention:
            return []
        cands = [_candidate(c) for c in commit.list_committed(self.storage)]
        doomed = to_delete(cands, self.retention, protected=set())
        for c in doomed:
            gc.delete_snapshot(self.storage, c.id)
        if doomed:
            log.info("retention deleted %d snapshot(s): %s", len(doomed), [c.step for c in doomed])
        return [c.id for c in doomed]

    def wait(self) -> None:
        """Wait for the save in flight; raise its error if it failed."""
        self.saver.wait()

    def close(self) -> None:
        """Wait for the save in flight (raising its error), release the root, restore the
        previous signal handlers."""
        if self._closed:
            return
        try:
            self.saver.close()
        finally:
            self._closed = True
            self._restore_signals()
            if self._lease is not None:
                lease.record(self.storage, self._lease.generation, "close")
                self._lease.release(newest=self._newest_committed)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("this CheckpointManager is closed")

    # -- preemption signals -------------------------------------------------------------------

    def _install_signals(self, signals: Sequence[int]) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, Any] = {}
        for sig in signals:
            previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        return previous

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._preempt_flag.set()
        log.warning("signal %s: saving at the next step", signal.Signals(signum).name)
        prev = self._previous_handlers.get(signum)
        if callable(prev):
            prev(signum, frame)

    def _restore_signals(self) -> None:
        for sig, handler in self._previous_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        self._previous_handlers = {}


def _candidate(c: commit.Committed) -> Candidate:
    s = c.marker.summary
    return Candidate(c.snapshot_id, c.step, dict(s.get("metrics", {})), tuple(s.get("tags", ())))


class _Decisions:
    """Step-keyed decisions on the control plane: ``decide/<step>`` exists when every rank must
    save at that step (see the module docstring for why step + 1)."""

    def __init__(self, comm: Comm, seq: int) -> None:
        self.comm = comm
        self.local: dict[int, str] = {}
        self.store = comm.store if isinstance(comm, StoreComm) else None
        self.prefix = f"trainsnap/manager-{seq}/decide"

    def publish(self, step: int, reason: str) -> None:
        if self.store is None:
            self.local.setdefault(step, reason)
            return
        key = f"{self.prefix}/{step}"
        # The first reason wins; preemption outranks a policy for the log only.
        self.store.compare_set(key, "", reason)

    def take(self, step: int) -> str | None:
        if self.store is None:
            return self.local.pop(step, None)
        key = f"{self.prefix}/{step}"
        if not self.store.check([key]):
            return None
        reason = str(self.store.get(key).decode())
        if self.comm.is_coordinator:
            old = f"{self.prefix}/{step - 16}"  # every rank is long past that step
            if self.store.check([old]):
                self.store.delete_key(old)
        return reason
