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

Tiers: with ``local=LocalTier(...)``, frequent snapshots (its ``interval``) go to a fast local
tier and durable ones (``interval``, preemption) are saved there too and then promoted to
``root`` in the background (objects, manifest, marker). Restore takes the newest snapshot that
loads, whichever tier holds it, and falls back snapshot by snapshot and tier by tier. Only
snapshots on ``root`` count as durable (:attr:`CheckpointManager.durable_step`).

With ``memory=MemoryTier(...)``, snapshots go to the nodes' memory as often as every step,
replicated to partner nodes, and durable saves promote the memory snapshot of their step
(:mod:`trainsnap.manager.memory_tier`); restore tries a memory snapshot first where it is the
newest (:mod:`trainsnap.manager.memory_restore`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import signal
import statistics
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from trainsnap.api.async_saver import AsyncSaver, SaveHandle
from trainsnap.api.options import SaveOptions
from trainsnap.api.snapshots import agree_damage, load
from trainsnap.errors import (
    CommitFailedError,
    InvalidArgumentError,
    NotFoundError,
    TrainsnapError,
)
from trainsnap.format.manifest import Manifest, id_step, level_rank
from trainsnap.manager import collection, lease, memory_restore, progress, restarts
from trainsnap.manager.between_saves import run_before_next_save
from trainsnap.manager.decisions import Decisions
from trainsnap.manager.housekeeping import Housekeeper, SaveGate
from trainsnap.manager.memory_tier import MemorySaves
from trainsnap.manager.options import LocalTier, ManagerOptions, MemoryTier
from trainsnap.manager.policies import (
    StepInfo,
    as_retention,
    as_save_policies,
)
from trainsnap.manager.progress import ProgressRecorder
from trainsnap.manager.quantize import quantize_history
from trainsnap.manager.tiers import Tier, open_local, promote
from trainsnap.protocol import commit
from trainsnap.protocol.control_plane import Comm, comm_for
from trainsnap.protocol.save_protocol import run_save
from trainsnap.protocol.snapshot_info import SnapshotInfo
from trainsnap.state.train_state import TrainState
from trainsnap.storage import Root, open_storage

log = logging.getLogger(__name__)

_PROCESS_START = time.time()
"""When this process started, as near as it can tell: the kernel's start time of the process,
or when trainsnap was imported."""
try:
    with open("/proc/self/stat") as _stat, open("/proc/stat") as _boot:
        _ticks = int(_stat.read().rsplit(")", 1)[1].split()[19])
        _btime = next(int(line.split()[1]) for line in _boot if line.startswith("btime"))
        _PROCESS_START = _btime + _ticks / os.sysconf("SC_CLK_TCK")
except (OSError, ValueError, IndexError, StopIteration):
    pass

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
        self.local_policies = as_save_policies(local.interval if local else None)
        self.weights_policies = as_save_policies(options.weights_interval)
        self.retention = as_retention(retention)
        self.durable = Tier(
            "durable", self.storage, self.retention, single_writer=options.single_writer
        )
        self.local: Tier | None = None
        if local is not None:
            local_storage = open_local(local.root, local.node, local.partner, storage_options)
            self.local = Tier(
                "local",
                local_storage,
                as_retention(local.retention),
                single_writer=options.single_writer,
            )
        self.async_save = async_save
        self.comm: Comm = comm_for(options.coordinator, options.timeout)
        self.memory: MemorySaves | None = None
        self.memory_policies = as_save_policies(memory.interval if memory else None)
        if memory is not None:
            self.memory = MemorySaves(memory, self.storage, self.comm, sync=not async_save)
        self.saver = AsyncSaver(
            max_in_flight=options.max_in_flight,
            skip_if_busy=options.skip_if_busy,
            staging_budget=options.staging_budget,
        )
        self._restored_at: float | None = None
        self._progress: ProgressRecorder | None = None
        self._decisions = Decisions(self.comm, next(_manager_seq), options.decision_seconds)
        self._housekeeper = Housekeeper(options.after_commit_queue)
        self._gate = SaveGate()
        self._promoting: set[str] = set()
        """Snapshots committed on the local tier and waiting for promotion: kept by retention."""
        self._preempt_flag = threading.Event()
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
        if self.memory is not None and self.comm.is_coordinator:
            promoter = self.memory.promoter
            promoter.fence, promoter.gate = self.durable.fence, self._gate
            promoter.on_promoted = lambda m, n: self._committed(0, self.durable, None, m, n)
        self._previous_handlers = self._install_signals(options.preemption_signals)

    # -- start, restore -------------------------------------------------------------------

    def _start(self) -> None:
        for tier in self._tiers():
            tier.start()
        gen = self.generation
        assert gen is not None
        evs = lease.events(self.storage)
        crashed = lease.last_generation_crashed(evs, gen, storage=self.storage)
        if crashed is not None:
            lease.record(
                self.storage,
                gen,
                "crash_detected",
                previous_generation=crashed["generation"],
                last_event=crashed["kind"],
                last_time=crashed["time"],
            )
            log.warning(
                "the previous job on %s (generation %s) ended without closing: crash after its "
                "%r event",
                self.storage.url,
                crashed["generation"],
                crashed["kind"],
            )
        lease.record(
            self.storage,
            gen,
            "start",
            interval=repr(self.policies),
            **progress.start_fields(self.options.progress_seconds, self.storage),
        )
        self.observed_mtbf, _ = lease.observed_mtbf(lease.events(self.storage))

    def _tiers(self) -> list[Tier]:
        return [self.durable] if self.local is None else [self.local, self.durable]

    def _record(self, kind: str, **fields: Any) -> None:
        if self.comm.is_coordinator and self.generation is not None:
            lease.record(self.storage, self.generation, kind, **fields)

    @property
    def durable_step(self) -> int | None:
        """The newest step committed on the durable root (``root``); a snapshot only on the
        local tier does not protect against losing the node."""
        found = commit.list_committed(self.storage)
        return found[-1].step if found else None

    def tiers(self) -> dict[str, list[str]]:
        """Which tiers hold each committed snapshot, by id."""
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
        to older ones (and from the local tier to the durable one) when it is damaged, saying
        why. Snapshots that cannot give ``level`` (a weights-only save) are passed over unless
        ``allow_downgrade``. None when no tier holds any. With ``step``, only the snapshots of
        that step are candidates (``NotFoundError`` naming the steps held when none is)."""
        started = time.perf_counter()
        in_memory = []
        if self.memory is not None:
            self.memory.start(self.generation)
            in_memory = memory_restore.candidates(self.memory)
        candidates = self._candidates(state, level, allow_downgrade, in_memory)
        if step is not None:
            steps = sorted({id_step(sid) for sid, _ in candidates})
            candidates = [(sid, tiers) for sid, tiers in candidates if id_step(sid) == step]
            if not candidates:
                raise NotFoundError(
                    f"no committed snapshot of step {step} that can give level {level!r} on "
                    f"{[t.storage.url for t in self._tiers()]}; steps held: {steps or 'none'}",
                    path=self.storage.url,
                )
        for sid, tier_names in candidates:
            for name in tier_names:
                tier = self.local if name == "local" and self.local else self.durable
                try:
                    if name == "memory" and self.memory is not None:
                        info = memory_restore.restore(
                            self.memory,
                            state,
                            sid,
                            level=level,
                            allow_downgrade=allow_downgrade,
                            timeout=self.options.timeout,
                        )
                    else:
                        info = load(
                            state,
                            tier.storage,
                            snapshot=sid,
                            level=level,
                            allow_downgrade=allow_downgrade,
                            coordinator=self.options.coordinator,
                            timeout=self.options.timeout,
                        )
                except TrainsnapError as e:
                    if not self._agree_fallback(e):
                        raise
                    log.warning(
                        "snapshot %s on the %s tier cannot be restored, trying the next: %s",
                        sid,
                        name,
                        e,
                    )
                    self._record("restore_failed", snapshot=sid, tier=name, error=str(e)[:500])
                    continue
                self._last_save_step, self._last_save_time = info.step, time.monotonic()
                self._restored_at = time.monotonic()
                sources = self._all_sources(info) if name == "memory" else {}
                self._record(
                    "restore",
                    snapshot=info.id,
                    step=info.step,
                    level=info.level,
                    tier=name,
                    sources=sources,
                    seconds=time.perf_counter() - started,
                    since_start=time.time() - _PROCESS_START,
                )
                self._log_restart()
                return info
        if candidates:
            raise TrainsnapError(
                f"none of the {len(candidates)} committed snapshots of "
                f"{[t.storage.url for t in self._tiers()]} could be restored; see the warnings "
                "above for each one's damage"
            )
        return None

    def _all_sources(self, info: SnapshotInfo) -> dict[str, int]:
        """(all ranks) Where every rank's restored bytes came from, summed (coordinator; {}
        elsewhere): the restart log says whether a node took its shards from partners."""
        session = self.comm.session("restore-sources")
        try:
            said = session.gather("sources", dict(info.sources))
        finally:
            session.close()
        total: dict[str, int] = {}
        for sources in said or ():
            for where, nbytes in sources.items():
                total[where] = total.get(where, 0) + int(nbytes)
        return total

    def _log_restart(self) -> None:
        """(coordinator) One line on what this restart lost and how long it took."""
        if not self.comm.is_coordinator:
            return
        runs = restarts.history(lease.events(self.storage), lease.progress(self.storage)).runs
        if len(runs) < 2 or runs[-1].lost_steps is None:
            return
        previous, run = runs[-2], runs[-1]
        log.info(
            "restart: generation %d restored step %s (%s): lost %s%d step(s), %.1f s of training; "
            "the previous run reached step %s and ended with %s; restore %.3f s, %.1f s after "
            "the process started",
            run.generation,
            run.restored_step,
            run.restored_snapshot,
            "at least " if run.lost_is_lower_bound else "",
            run.lost_steps,
            run.lost_seconds or 0.0,
            previous.step_reached,
            previous.end,
            run.restore_seconds or 0.0,
            run.since_start_seconds or 0.0,
        )

    def _agree_fallback(self, error: TrainsnapError) -> bool:
        """Fall back to an older snapshot only if every rank's failure is damage to this one,
        by the rule ``ts.load`` applies to ``"latest"`` (:func:`trainsnap.api.snapshots.load`);
        a state that does not fit, a level the snapshot cannot give or a newer format would not
        fit an older snapshot either, and silently resuming from further back would lose
        progress. Every rank decides alike."""
        return agree_damage(self.comm, error)

    def _candidates(
        self,
        state: Any,
        level: str,
        allow_downgrade: bool,
        in_memory: Sequence[tuple[str, tuple[int, str]]] = (),
    ) -> list[tuple[str, list[str]]]:
        """(id, tiers holding it) newest first, decided by the coordinator so every rank tries
        the same sequence; a snapshot in ``in_memory`` is tried from the memory tier first."""
        session = self.comm.session("restore")
        try:
            found = None
            if self.comm.is_coordinator:
                by_id: dict[str, tuple[tuple[int, str], list[str]]] = {}
                for tier in self._tiers():
                    for c in commit.list_committed(tier.storage):
                        if (
                            isinstance(state, TrainState)
                            and not allow_downgrade
                            and level_rank(str(c.marker.summary.get("level", "weights")))
                            < min(level_rank(level), level_rank(state.level_cap()))
                        ):
                            continue  # cannot give the level asked (e.g. a weights-only save)
                        key = (c.step, str(c.marker.summary.get("created", "")))
                        by_id.setdefault(c.snapshot_id, (key, []))[1].append(tier.name)
                for sid, key in in_memory:
                    by_id.setdefault(sid, (key, []))[1].insert(0, "memory")
                ordered = sorted(by_id.items(), key=lambda kv: kv[1][0], reverse=True)
                found = [(sid, names) for sid, (_, names) in ordered]
            return list(session.broadcast("candidates", found))
        finally:
            session.close()

    # -- the loop ---------------------------------------------------------------------------

    def _note_progress(self, step: int, now: float) -> None:
        """(coordinator) The restart log's first step after a restore (how far the run got is
        recorded when ``step()`` returns: :mod:`trainsnap.manager.progress`)."""
        if not self.comm.is_coordinator or self.generation is None:
            return
        if self._restored_at is not None:
            seconds = now - self._restored_at
            first = lambda: self._record("first_step", step=step, seconds=seconds)  # noqa: E731
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
        kinds = (
            ("durable", self.policies),
            ("local", self.local_policies),
            ("weights", self.weights_policies),
            ("memory", self.memory_policies),
        )
        local = {k for k, ps in kinds if any(p.should_save(info) for p in ps if not p.shared)}

        def shared() -> set[str]:
            return {k for k, ps in kinds if any(p.should_save(info) for p in ps if p.shared)}

        signalled = self._preempt_flag.is_set()
        self._preempt_flag.clear()
        wanted = local | self._decisions.take(shared, signalled, self._window(info))
        if not wanted:
            return False
        preempt = "preempt" in wanted
        if self.memory is not None and wanted & {"memory", "durable", "preempt"}:
            durable = bool(wanted & {"durable", "preempt"})
            return self._memory_step(step, state, metrics, durable=durable, preempt=preempt)
        if preempt or "durable" in wanted:
            handle = self.save(step, state, metrics=metrics)
        elif "local" in wanted:
            handle = self.save(step, state, metrics=metrics, tier="local")
        else:
            handle = self.save(step, state, metrics=metrics, parts=("model",))
        if preempt:
            self.preempted = True
            if isinstance(handle, SaveHandle):
                handle.wait()  # a preempted job must not exit before its save is durable
            self._housekeeper.drain()  # ... nor before it is promoted to the durable root
            self._record("preempt", step=step)
        return handle is not None

    def _memory_step(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, float] | None,
        *,
        durable: bool,
        preempt: bool,
    ) -> bool:
        """A memory snapshot at this step, promoted to the durable root when ``durable``
        (:mod:`trainsnap.manager.memory_tier`); False when skipped (the previous one in flight)."""
        assert self.memory is not None
        self.memory.start(self.generation)
        if not self.memory.decide(force=durable):
            return False
        tree, opts = self.save_options.request(state, step)
        if metrics:
            measured = {str(k): float(v) for k, v in metrics.items()}
            opts.options = replace(opts.options, meta={**opts.options.meta, "metrics": measured})
        self.memory.save(tree, opts, promote=durable)
        self._save_costs.append(self.memory.pause)  # what Young/Daly weigh: the blocking cost
        self._last_save_step, self._last_save_time = step, time.monotonic()
        if preempt:
            self.preempted = True
            self.memory.drain()  # a preempted job must not exit before its save is durable
            self._housekeeper.drain()
            self._record("preempt", step=step)
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
        meta: dict[str, Any] = {}
        if metrics:
            meta["metrics"] = {str(k): float(v) for k, v in metrics.items()}
        if tags:
            meta["tags"] = [str(t) for t in tags]
        tree, opts = self.save_options.request(state, step, parts)
        opts.options = replace(opts.options, meta={**opts.options.meta, **meta})
        target = self.local if self.local is not None else self.durable
        promote_to = self.durable if (tier == "durable" and self.local is not None) else None
        opts.fence = target.fence if self.comm.is_coordinator else None
        self._housekeeper.raise_error()
        if self.async_save:
            self.saver.wait_for_room()  # counted by the gate from its start, not while waiting
        token = self._gate.begin() if self.comm.is_coordinator else 0
        if self.comm.is_coordinator:
            opts.on_commit = lambda m, n: self._committed(token, target, promote_to, m, n)
        t0 = time.perf_counter()
        result: SaveHandle | SnapshotInfo | None = None
        try:
            if self.async_save:
                result = self.saver.save(tree, target.storage, opts, self.comm)
                if result is not None:
                    result.add_done_callback(lambda _: self._gate.end(token))
                    self._handles.append(result)
                    self._save_costs.append(result.pause)
            else:
                r = run_save(tree, target.storage, opts, self.comm)
                self._save_costs.append(time.perf_counter() - t0)
                result = r.info(target.storage.url)
        finally:
            if not isinstance(result, SaveHandle):
                self._gate.end(token)
        if result is not None:
            self._last_save_step, self._last_save_time = step, time.monotonic()
        return result

    def _committed(
        self,
        token: int,
        tier: Tier,
        promote_to: Tier | None,
        manifest: Manifest,
        bytes_written: int,
    ) -> None:
        """(coordinator, on the thread that committed) Record the save in the restart log (one
        small object: a crash right after the commit must not lose it), then hand the rest to
        the background worker; waits only when its queue is full."""
        self._gate.end(token)
        tier.newest, tier.newest_step = manifest.snapshot_id, manifest.step
        self.last_save_bytes = (manifest.nbytes, bytes_written)
        self._record(
            "save",
            snapshot=manifest.snapshot_id,
            step=manifest.step,
            pause=self._save_costs[-1] if self._save_costs else None,
            nbytes=manifest.nbytes,
            bytes_written=bytes_written,
            level=manifest.level,
            tier=tier.name,
        )
        if promote_to is not None:
            self._promoting.add(manifest.snapshot_id)
        what = f"after-commit work of snapshot {manifest.snapshot_id}"
        work = lambda: self._after_commit(tier, promote_to, manifest, bytes_written)  # noqa: E731
        if promote_to is None and self.local is None and tier is self.durable:
            run_before_next_save(self._housekeeper, what, work)  # disk within n + 1 snapshots
        else:
            self._housekeeper.submit(what, work)

    def _after_commit(
        self, tier: Tier, promote_to: Tier | None, manifest: Manifest, bytes_written: int
    ) -> None:
        """(coordinator, background worker) promote, apply retention, quantise, collect."""
        touched = [tier]
        if promote_to is not None:
            copied = promote(
                tier.storage, promote_to.storage, manifest.snapshot_id, fence=promote_to.fence
            )
            self._promoting.discard(manifest.snapshot_id)
            promote_to.newest, promote_to.newest_step = manifest.snapshot_id, manifest.step
            self._record(
                "promote", snapshot=manifest.snapshot_id, step=manifest.step, bytes_copied=copied
            )
            touched.append(promote_to)
        for t in touched:
            t.apply_retention(protected=frozenset(self._promoting))
            if self.options.quantize_history:
                self._quantize(t)
            self._collect(t)

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
        every tier."""
        self._housekeeper.drain()
        protected = frozenset(self._promoting)
        return [sid for t in self._tiers() for sid in t.apply_retention(protected)]

    def wait(self) -> None:
        """Wait for the save in flight and the after-commit work of every committed save
        (promotion, retention, collection); raise the first error of either."""
        try:
            self.saver.wait()
            if self.memory is not None:
                self.memory.drain()
        finally:
            self._housekeeper.drain()
        self._housekeeper.raise_error()

    def close(self) -> None:
        """Wait for the save in flight and the after-commit work (raising the first error of
        either), release the root, restore the previous signal handlers."""
        if self._closed:
            return
        try:
            try:
                self.saver.close()
                if self.memory is not None:
                    self.memory.close()
            finally:
                self._housekeeper.close()
        finally:
            self._closed = True
            self._restore_signals()
            if self.comm.is_coordinator and self.generation is not None:
                self._record("close", step=self._progress.reached if self._progress else None)
                for tier in self._tiers():
                    tier.release()

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
