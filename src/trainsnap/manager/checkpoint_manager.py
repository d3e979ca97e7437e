"""The CheckpointManager: when to save, what to keep, how to come back.

Every rank creates the manager and calls it at the same points of the loop. Decisions are taken
once and shared, so ranks never disagree about whether a step saves:

* policies that every rank evaluates alike (``Every(steps=N)``, a predicate on the step) are
  evaluated locally, at every step;
* decisions that depend on a clock, a measurement or a signal (``Every(seconds=T)``,
  ``YoungDaly``, SIGTERM/SIGUSR1 on any rank) are taken by the coordinator and published on the
  control plane at *decision steps*: a sequence the coordinator announces ahead, each decision
  naming the next one, about ``ManagerOptions.decision_seconds`` of training apart. At a
  decision step every rank reads the coordinator's decision for it (one store read; the
  coordinator writes it there); every other step costs no control-plane operation. A rank
  signalled between decision steps asks for a preemption save once (one store write), and the
  coordinator includes it in its next decision. Ranks count their ``step()`` calls, so they agree
  on which call is a decision step whatever the step numbers.

After each committed save the coordinator hands the rest to a background worker (its own
bounded queue; errors are raised by the next ``step()``, ``save()``, ``wait()`` or
``close()``): record the save, promote it to the durable tier, apply the retention policies (the
newest snapshot, saves in flight and snapshots waiting for promotion are never deleted;
deleting removes the marker first), quantise history, and collect. While the manager holds the
root's lease it is the root's only writer, so objects that no committed snapshot references are
collected at once, collection pausing while one of its saves is in flight
(:class:`~trainsnap.manager.housekeeping.SaveGate`); where other writers may exist (the lease was
taken over) only objects older than ``gc_grace`` go. A save handle is done at its commit, before
that work; :meth:`CheckpointManager.wait` and :meth:`CheckpointManager.close` wait for it too.

Tiers (:mod:`trainsnap.manager.tiers`): the manager composes a list of them, fastest first --
the memory tier (``memory=MemoryTier(...)``: the nodes' memory, replicated to partner nodes),
the local tier (``local=LocalTier(...)``) and the durable ``root`` -- each with its interval and
retention. A step any of them wants is captured and staged once and saved by the fastest tier;
each other tier that wants it gets it by promotion in the background
(:mod:`trainsnap.manager.schedule` states the rule). Every save goes through the manager's one
saver and staging pool (``ManagerOptions.staging_budget`` covers every tier's saves together);
promotion, retention and collection run on its one background worker. Restore takes the newest
snapshot that loads, whichever tier holds it, and falls back snapshot by snapshot and tier by
tier (:mod:`trainsnap.manager.restore`). Only snapshots on ``root`` count as durable
(:attr:`CheckpointManager.durable_step`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from trainsnap.api.async_saver import AsyncSaver, SaveHandle
from trainsnap.api.options import SaveOptions
from trainsnap.errors import CommitFailedError, InvalidArgumentError
from trainsnap.format.manifest import Manifest
from trainsnap.manager import collection, lease, progress, restore
from trainsnap.manager.between_saves import run_before_next_save
from trainsnap.manager.decisions import Decisions
from trainsnap.manager.housekeeping import Housekeeper, SaveGate
from trainsnap.manager.memory_tier import MemorySaves
from trainsnap.manager.options import LocalTier, ManagerOptions, MemoryTier
from trainsnap.manager.policies import StepInfo, as_retention, as_save_policies
from trainsnap.manager.preemption import PreemptionSignals
from trainsnap.manager.progress import ProgressRecorder
from trainsnap.manager.promotion import promote
from trainsnap.manager.quantize import quantize_history
from trainsnap.manager.schedule import SaveDecision, Schedule
from trainsnap.manager.tiers import DiskTier, Tier, open_local
from trainsnap.protocol import commit
from trainsnap.protocol.control_plane import Comm, comm_for
from trainsnap.protocol.save_protocol import run_save
from trainsnap.protocol.snapshot_info import SnapshotInfo
from trainsnap.storage import Root, open_storage

log = logging.getLogger(__name__)


@functools.cache
def _process_start() -> float:
    """When this process started, as near as it can tell: the kernel's start time of the
    process, or the first time this was asked. Read once."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/stat") as boot:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            btime = next(int(line.split()[1]) for line in boot if line.startswith("btime"))
            return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


_manager_seq = itertools.count(1)
_MAX_WINDOW = 10_000
"""Most steps between two decision steps, however short the steps."""


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
        local: a fast local tier in front of ``root`` (:class:`~trainsnap.LocalTier`).
        memory: snapshots in the nodes' memory, replicated to partner nodes
            (:class:`~trainsnap.MemoryTier`); durable saves then promote its snapshots.
        save_options: what every save records and how it stores tensor data
            (:class:`~trainsnap.SaveOptions`: compression, chunk size...).
        options: how saves run (:class:`~trainsnap.ManagerOptions`: saves in flight, staging
            budget, collection grace, preemption signals, weights-only saves, coordinator...).
        storage_options: passed to the storage backends of ``root`` and the local tier.
    """

    def __init__(
        self,
        root: Root,
        *,
        interval: Any = None,
        retention: Any = None,
        async_save: bool = True,
        local: LocalTier | None = None,
        memory: MemoryTier | None = None,
        save_options: SaveOptions | None = None,
        options: ManagerOptions | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.options = options = options or ManagerOptions()
        self.save_options = save_options or SaveOptions()
        self.storage = open_storage(root, **dict(storage_options or {}))
        self.policies = as_save_policies(interval)
        self.retention = as_retention(retention)
        self.comm: Comm = comm_for(options.coordinator, options.timeout)
        self.durable = DiskTier(
            "durable",
            self.storage,
            self.retention,
            self.policies,
            single_writer=options.single_writer,
        )
        self.local: DiskTier | None = None
        if local is not None:
            self.local = DiskTier(
                "local",
                open_local(local.root, local.node, local.partner, storage_options),
                as_retention(local.retention),
                as_save_policies(local.interval),
                single_writer=options.single_writer,
            )
        self.memory = MemorySaves(memory, self.storage, self.comm) if memory else None
        self.tier_list: list[Tier] = [t for t in (self.memory, self.local, self.durable) if t]
        """Every tier, fastest first; the durable root last."""
        self.async_save = async_save
        self.saver = AsyncSaver(
            max_in_flight=options.max_in_flight,
            skip_if_busy=options.skip_if_busy,
            staging_budget=options.staging_budget,
        )
        self._decisions = Decisions(self.comm, next(_manager_seq), options.decision_seconds)
        self.schedule = Schedule(
            self.tier_list, as_save_policies(options.weights_interval), self._decisions
        )
        self._restored_at: float | None = None
        self._progress: ProgressRecorder | None = None
        self._housekeeper = Housekeeper(options.after_commit_queue)
        self._gate = SaveGate()
        self._promoting: set[str] = set()
        """Snapshots committed on a faster tier and waiting for promotion: kept by retention."""
        self.preempted = False
        self._closed = False
        self._last_save_step: int | None = None
        self._last_save_time: float | None = None
        self._last_step_time: float | None = None
        self._save_costs: deque[float] = deque(maxlen=20)
        self._step_times: deque[float] = deque(maxlen=200)
        self._handles: list[SaveHandle] = []
        self.last_save_bytes: tuple[int, int] | None = None
        """(bytes referenced, bytes written) of the newest save committed by this manager."""
        self.observed_mtbf: float | None = None
        if self.comm.is_coordinator:
            self._start()
        self._signals = PreemptionSignals(options.preemption_signals)

    # -- start, restore -------------------------------------------------------------------

    def _start(self) -> None:
        for tier in self._tiers():
            tier.start()
        assert self.generation is not None
        self.observed_mtbf = lease.record_start(
            self.storage,
            self.generation,
            interval=repr(self.policies),
            **progress.start_fields(self.options.progress_seconds, self.storage),
        )

    def _tiers(self) -> list[DiskTier]:
        """The disk tiers (leases, listings), fastest first."""
        return [self.durable] if self.local is None else [self.local, self.durable]

    def record(self, kind: str, **fields: Any) -> None:
        """(coordinator) One event of the restart log (a no-op elsewhere)."""
        if self.comm.is_coordinator and self.generation is not None:
            lease.record(self.storage, self.generation, kind, **fields)

    @property
    def durable_step(self) -> int | None:
        """The newest step committed on the durable root (``root``); a snapshot only on the
        local tier does not protect against losing the node."""
        found = commit.list_committed(self.storage)
        return found[-1].step if found else None

    def tiers(self) -> dict[str, list[str]]:
        """Which disk tiers hold each committed snapshot, by id."""
        out: dict[str, list[str]] = {}
        for tier in self._tiers():
            for c in commit.list_committed(tier.storage):
                out.setdefault(c.snapshot_id, []).append(tier.name)
        return out

    @property
    def generation(self) -> int | None:
        """The durable root's writer generation held by this job (coordinator only)."""
        return self.durable.lease.generation if self.durable.lease else None

    def restore(
        self,
        state: Any,
        level: str = "strict",
        *,
        allow_downgrade: bool = False,
        step: int | None = None,
    ) -> SnapshotInfo | None:
        """Restore the newest committed snapshot that loads, whichever tier holds it; fall back
        to older ones (and from a faster tier to a slower one) when it is damaged, saying
        why. Snapshots that cannot give ``level`` (a weights-only save) are passed over unless
        ``allow_downgrade``. None when no tier holds any. With ``step``, only the snapshots of
        that step are candidates (``NotFoundError`` naming the steps held when none is)."""
        info = restore.restore(self, state, level, allow_downgrade, step, _process_start())
        if info is not None:
            self._last_save_step, self._last_save_time = info.step, time.monotonic()
            self._restored_at = time.monotonic()
        return info

    # -- the loop ---------------------------------------------------------------------------

    def _note_progress(self, step: int, now: float) -> None:
        """(coordinator) The restart log's first step after a restore (how far the run got is
        recorded when ``step()`` returns: :mod:`trainsnap.manager.progress`)."""
        if not self.comm.is_coordinator or self.generation is None:
            return
        if self._restored_at is not None:
            seconds = now - self._restored_at
            first = lambda: self.record("first_step", step=step, seconds=seconds)  # noqa: E731
            self._housekeeper.submit("recording the first step", first)
            self._restored_at = None

    def _window(self, info: StepInfo) -> int:
        """(coordinator) Steps to the next decision step: about ``decision_seconds`` of
        training at the median of the recent step times; 1 before any was measured."""
        if not info.step_times:
            return 1
        step_time = statistics.median(info.step_times[-20:])
        if step_time <= 0:
            return _MAX_WINDOW
        return max(1, min(_MAX_WINDOW, int(self.options.decision_seconds / step_time)))

    def step(self, step: int, state: Any, metrics: Mapping[str, float] | None = None) -> bool:
        """Call after each optimizer step. Saves when a policy (or a preemption) says so;
        returns True if it saved. After a preemption save, :attr:`preempted` is True. Raises
        the error of after-commit work (promotion, retention, collection) that failed since the
        last call. A step that does not save makes no control-plane operation except at a
        decision step (see the module docstring). The restart log counts ``step`` as reached
        once this returns (:mod:`trainsnap.manager.progress`)."""
        saved = self._step(step, state, metrics)
        if self._progress is None and self.comm.is_coordinator and self.generation is not None:
            submit = functools.partial(self._housekeeper.submit, wait=False)
            self._progress = ProgressRecorder(
                self.storage, self.generation, self.options.progress_seconds, submit
            )
        if self._progress is not None:
            self._progress.returned(step, saved=saved)
        return saved

    def _step(self, step: int, state: Any, metrics: Mapping[str, float] | None) -> bool:
        self._check_open()
        self._housekeeper.raise_error()
        now = time.monotonic()
        if self._last_step_time is not None:
            self._step_times.append(now - self._last_step_time)
        self._last_step_time = now
        self._note_progress(step, now)
        info = StepInfo(
            step=step,
            now=now,
            last_save_step=self._last_save_step,
            last_save_time=self._last_save_time,
            save_costs=tuple(self._save_costs),
            step_times=tuple(self._step_times),
            mtbf_observed=self.observed_mtbf,
        )
        decision = self.schedule.decide(info, self._signals.take(), self._window(info))
        if decision is None:
            return False
        if self._skipped(decision):
            return False
        handle = self._save(step, state, decision, metrics)
        if decision.preempt:
            self.preempted = True
            if isinstance(handle, SaveHandle):
                handle.wait()  # a preempted job must not exit before its save is durable
            self._housekeeper.drain()  # ... nor before it is promoted to the durable root
            self.record("preempt", step=step)
        return handle is not None

    def _skipped(self, decision: SaveDecision) -> bool:
        """(all ranks) A memory snapshot only the memory tier wants, skipped because the
        coordinator's saver is busy (:meth:`Schedule.skip`); starts the memory tier first."""
        memory = self.memory
        if memory is None or decision.front is not memory:
            return False
        memory.start(self.generation)
        if not decision.skippable or memory.options.wait_if_busy:
            return False
        if not self.schedule.skip(busy=self.saver.in_flight() > 0):
            return False
        memory.skipped += 1
        log.info(
            "memory snapshot skipped: the previous save is still in flight (%d skipped so far)",
            memory.skipped,
        )
        return True

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, float] | None = None,
        tags: Sequence[str] = (),
        tier: str = "durable",
        parts: Sequence[str] | None = None,
    ) -> SaveHandle | SnapshotInfo | None:
        """Save now (asynchronously if the manager is). ``tags`` pin the snapshot; ``tier``
        "local" saves to the local tier only; ``parts`` saves only those parts of a
        :class:`TrainState` (e.g. ``("model",)``), and the snapshot says which level it gives.
        A durable save with a local tier is saved locally, then promoted to the durable root."""
        self._check_open()
        if tier not in ("durable", "local"):
            raise InvalidArgumentError(f"tier must be 'durable' or 'local', got {tier!r}")
        if tier == "local" and self.local is None:
            raise InvalidArgumentError(
                "tier='local' needs a local tier: pass local=LocalTier(root=...) to the manager"
            )
        return self._save(step, state, self.schedule.explicit(tier), metrics, tags, parts)

    def _save(
        self,
        step: int,
        state: Any,
        decision: SaveDecision,
        metrics: Mapping[str, float] | None,
        tags: Sequence[str] = (),
        parts: Sequence[str] | None = None,
    ) -> SaveHandle | SnapshotInfo | None:
        """One capture and one staging of the state, saved to ``decision.front`` through the
        manager's saver; its commit hands the promotions to the background worker."""
        meta: dict[str, Any] = {}
        if metrics:
            meta["metrics"] = {str(k): float(v) for k, v in metrics.items()}
        if tags:
            meta["tags"] = [str(t) for t in tags]
        if decision.weights_only and parts is None:
            parts = ("model",)
        tree, opts = self.save_options.request(state, step, parts)
        opts.options = replace(opts.options, meta={**opts.options.meta, **meta})
        front, coordinator = decision.front, self.comm.is_coordinator
        if front is self.memory:
            # content addresses are checked block by block on each copy
            opts.options = replace(opts.options, compression=None)
        opts.committer = front.committer
        opts.fence = front.fence if coordinator else None
        self._housekeeper.raise_error()
        gated = coordinator and any(t is not self.memory for t in decision.tiers)
        if self.async_save:
            self.saver.wait_for_room()  # counted by the gate from its start, not while waiting
        token = self._gate.begin() if gated else 0
        opts.on_commit = lambda sid, m, n: self._committed(token, decision, sid, m, n)
        t0 = time.perf_counter()
        result: SaveHandle | SnapshotInfo | None = None
        committed = False
        try:
            if self.async_save:
                result = self.saver.save(
                    tree, front.storage, opts, self.comm, alone=front is self.memory
                )
                if result is not None:
                    self._handles.append(result)
                    self._save_costs.append(result.pause)
                    # a failed save ends its gate token; a committed one's ends with its promotions
                    result.add_done_callback(lambda h: None if h.result else self._gate.end(token))
                    committed = True
            else:
                r = run_save(tree, front.storage, opts, self.comm)
                self._save_costs.append(time.perf_counter() - t0)
                result = r.info(front.storage.url)
                committed = True
        finally:
            if not committed:
                self._gate.end(token)
        if result is not None:
            self._last_save_step, self._last_save_time = step, time.monotonic()
        return result

    def _committed(
        self,
        token: int,
        decision: SaveDecision,
        sid: str,
        manifest: Manifest | None,
        bytes_written: int,
    ) -> None:
        """(every rank, on the thread that committed) The coordinator records the save in the
        restart log (one small object: a crash right after the commit must not lose it); the
        promotions, retention and collection go to the background worker (every rank's, for
        the collective promotions of a memory snapshot). Waits only when its queue is full."""
        front, memory = decision.front, self.memory
        collective = memory is not None and front is memory
        if memory is not None and collective and decision.promote_to:
            memory.pin(sid)
        if manifest is not None:  # the coordinator
            front.newest, front.newest_step = sid, manifest.step
            self.last_save_bytes = (manifest.nbytes, bytes_written)
            if front is not memory:
                self.record(
                    "save",
                    snapshot=sid,
                    step=manifest.step,
                    pause=self._save_costs[-1] if self._save_costs else None,
                    nbytes=manifest.nbytes,
                    bytes_written=bytes_written,
                    level=manifest.level,
                    tier=front.name,
                )
            self._promoting.update([sid] if decision.promote_to else [])
        elif not (collective and decision.promote_to):
            return
        if not decision.promote_to:
            self._gate.end(token)
            if front is memory:
                return
        what = f"after-commit work of snapshot {sid}"
        work = lambda: self._after_commit(token, decision, sid, manifest, bytes_written)  # noqa: E731
        if not decision.promote_to and self.local is None and front is self.durable:
            run_before_next_save(self._housekeeper, what, work)  # disk within n + 1 snapshots
        else:
            self._housekeeper.submit(what, work)

    def _after_commit(
        self,
        token: int,
        decision: SaveDecision,
        sid: str,
        manifest: Manifest | None,
        bytes_written: int,
    ) -> None:
        """(background worker) promote to each tier that wants the snapshot; then
        (coordinator) apply retention, quantise, collect on every disk tier touched."""
        front, memory = decision.front, self.memory
        touched = [] if front is memory else [front]
        try:
            for dst in decision.promote_to:
                copied = self._promote(front, dst, sid)
                if manifest is None:
                    continue
                dst.newest, dst.newest_step = sid, manifest.step
                touched.append(dst)
                if front is memory:  # what the restart log knows of a memory snapshot
                    self.record(
                        "save",
                        snapshot=sid,
                        step=manifest.step,
                        nbytes=manifest.nbytes,
                        bytes_written=copied,
                        level=manifest.level,
                        tier=dst.name,
                        promoted_from=front.name,
                    )
                else:
                    self.record("promote", snapshot=sid, step=manifest.step, bytes_copied=copied)
        finally:
            if memory is not None:
                memory.unpin(sid)
            self._promoting.discard(sid)
            self._gate.end(token)
        for t in touched if manifest is not None else ():
            t.apply_retention(protected=frozenset(self._promoting))
            if self.options.quantize_history:
                self._quantize(t)
            self._collect(t)

    def _promote(self, src: Tier, dst: Tier, sid: str) -> int:
        """One promotion (:func:`trainsnap.manager.promotion.promote`): a memory snapshot by
        every rank from its node's directory; a disk tier's by the coordinator alone."""
        coordinator = self.comm.is_coordinator
        writer = {"world_size": self.comm.world_size, "promoted_from": src.name}
        fence = dst.fence if coordinator else None
        if src is self.memory:
            return promote(
                src.storage,
                dst.storage,
                sid,
                writer=writer,
                objects=self.memory.objects(sid),
                comm=self.memory.promote_comm,
                fence=fence,
            )
        return promote(src.storage, dst.storage, sid, writer=writer, fence=fence)

    def _collect(self, tier: Tier) -> None:
        """Everything unreferenced at once while this manager holds the tier's lease (its saves
        gated), else what is older than ``gc_grace``."""
        try:
            tier.fence()
            sole_writer = tier.lease is not None
        except CommitFailedError:
            sole_writer = False
        if sole_writer:
            collection.collect(tier.storage, grace=None, gate=self._gate)
        else:
            collection.collect(tier.storage, grace=self.options.gc_grace)

    def _quantize(self, tier: Tier) -> None:
        """Older retained snapshots, never the newest: optimizer state at bfloat16 precision."""
        found = commit.list_committed(tier.storage)
        for c in found[:-1]:
            if not c.marker.summary.get("approximate"):
                quantize_history(tier.storage, c.snapshot_id, fence=tier.fence)

    def apply_retention(self) -> list[str]:
        """Delete the committed snapshots no retention policy keeps (never the newest), on
        every disk tier."""
        self._housekeeper.drain()
        protected = frozenset(self._promoting)
        return [sid for t in self._tiers() for sid in t.apply_retention(protected)]

    def wait(self) -> None:
        """Wait for the saves in flight and the after-commit work of every committed save
        (promotion, retention, collection); raise the first error of either."""
        try:
            self.saver.wait()
        finally:
            self._housekeeper.drain()
        self._housekeeper.raise_error()

    def close(self) -> None:
        """Wait for the saves in flight and the after-commit work (raising the first error of
        either), release the root, restore the previous signal handlers."""
        if self._closed:
            return
        try:
            try:
                self.saver.close()
            finally:
                self._housekeeper.close()
        finally:
            self._closed = True
            self._signals.restore()
            if self.comm.is_coordinator and self.generation is not None:
                self.record("close", step=self._progress.reached if self._progress else None)
                for tier in self._tiers():
                    tier.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("this CheckpointManager is closed")
