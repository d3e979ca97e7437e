"""The manager's restore: one loop over (snapshot, tier) candidates, newest first.

1. (all ranks) the candidates: every tier's committed snapshots that can give the level asked,
   newest first, each with the tiers holding it, fastest first (the coordinator lists the disk
   tiers; the memory tier's list is agreed by its nodes' leaders); the same list on every rank.
2. (all ranks) for each candidate in turn, each tier holding it: the tier's restore -- the
   ordinary load from the tier's root (:func:`trainsnap.api.snapshots.load`), the memory tier
   first fetching what its node lacks (:mod:`trainsnap.manager.memory_restore`). A failure that
   every rank agrees is damage to this snapshot (:func:`trainsnap.api.snapshots.agree_damage`)
   moves to the next (tier, then snapshot), logged and recorded; any other failure is raised:
   silently resuming from further back would lose progress.
3. (coordinator) the restart log records the restore: the tier, where the bytes came from, how
   long it took.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from trainsnap.api.snapshots import agree_damage, load
from trainsnap.errors import NotFoundError, TrainsnapError
from trainsnap.format.manifest import id_step, level_rank
from trainsnap.manager import lease, memory_restore, restarts
from trainsnap.manager.memory_tier import MemorySaves
from trainsnap.manager.options import ManagerOptions
from trainsnap.manager.tiers import Tier
from trainsnap.protocol import commit
from trainsnap.protocol.collective import all_reduce, decide
from trainsnap.protocol.control_plane import Comm, PeerLost
from trainsnap.protocol.snapshot_info import SnapshotInfo
from trainsnap.state.train_state import TrainState
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)


class CheckpointManager(Protocol):
    """What the restore needs of the :class:`~trainsnap.CheckpointManager`."""

    tier_list: list[Tier]
    comm: Comm
    storage: Storage
    options: ManagerOptions

    @property
    def generation(self) -> int | None: ...

    def record(self, kind: str, **fields: Any) -> None: ...


def restore(
    mgr: CheckpointManager,
    state: Any,
    level: str,
    allow_downgrade: bool,
    step: int | None,
    since_start: float,
) -> SnapshotInfo | None:
    """:meth:`CheckpointManager.restore` (module docstring)."""
    started = time.perf_counter()
    for tier in mgr.tier_list:
        if isinstance(tier, MemorySaves):
            tier.start(mgr.generation)
    candidates = _candidates(mgr, state, level, allow_downgrade)
    if step is not None:
        steps = sorted({id_step(sid) for sid, _ in candidates})
        candidates = [(sid, tiers) for sid, tiers in candidates if id_step(sid) == step]
        if not candidates:
            raise NotFoundError(
                f"no committed snapshot of step {step} that can give level {level!r} on "
                f"{[t.storage.url for t in mgr.tier_list]}; steps held: {steps or 'none'}",
                path=mgr.storage.url,
            )
    for sid, tiers in candidates:
        for tier in tiers:
            try:
                info = _restore_from(mgr, tier, state, sid, level, allow_downgrade)
            except TrainsnapError as e:
                if not agree_damage(mgr.comm, e):
                    raise
                log.warning(
                    "snapshot %s on the %s tier cannot be restored, trying the next: %s",
                    sid,
                    tier.name,
                    e,
                )
                mgr.record("restore_failed", snapshot=sid, tier=tier.name, error=str(e)[:500])
                continue
            sources = _all_sources(mgr, info) if isinstance(tier, MemorySaves) else {}
            mgr.record(
                "restore",
                snapshot=info.id,
                step=info.step,
                level=info.level,
                components=info.restore_record(),
                tier=tier.name,
                sources=sources,
                seconds=time.perf_counter() - started,
                since_start=time.time() - since_start,
            )
            _log_restart(mgr)
            return info
    if candidates:
        raise TrainsnapError(
            f"none of the {len(candidates)} committed snapshots of "
            f"{[t.storage.url for t in mgr.tier_list]} could be restored; see the warnings "
            "above for each one's damage"
        )
    return None


def _restore_from(
    mgr: CheckpointManager, tier: Tier, state: Any, sid: str, level: str, allow_downgrade: bool
) -> SnapshotInfo:
    """One candidate, once: the tier prepares (the memory tier fetches what its node lacks,
    and drops and refetches a copy its load finds damaged), then the ordinary load."""
    if isinstance(tier, MemorySaves):
        return memory_restore.restore(
            tier,
            state,
            sid,
            level=level,
            allow_downgrade=allow_downgrade,
            timeout=mgr.options.timeout,
        )
    return load(
        state,
        tier.prepare_restore(sid),
        snapshot=sid,
        level=level,
        allow_downgrade=allow_downgrade,
        coordinator=mgr.options.coordinator,
        timeout=mgr.options.timeout,
    )


def _candidates(
    mgr: CheckpointManager, state: Any, level: str, allow_downgrade: bool
) -> list[tuple[str, list[Tier]]]:
    """(all ranks) (id, tiers holding it) newest first, the same on every rank; a snapshot in
    the memory tier is tried from it first."""
    memory = [t for t in mgr.tier_list if isinstance(t, MemorySaves)]
    in_memory = memory[0].candidates() if memory else []
    disk = [t for t in mgr.tier_list if not isinstance(t, MemorySaves)]

    def listed(_: list[Any]) -> list[tuple[str, list[str]]]:
        by_id: dict[str, tuple[tuple[int, str], list[str]]] = {}
        for sid, key in in_memory:
            by_id.setdefault(sid, (key, []))[1].append("memory")
        for tier in disk:
            for c in commit.list_committed(tier.storage):
                if not _gives(state, c, level, allow_downgrade):
                    continue  # cannot give the level asked (e.g. a weights-only save)
                key = (c.step, str(c.marker.summary.get("created", "")))
                by_id.setdefault(c.snapshot_id, (key, []))[1].append(tier.name)
        ordered = sorted(by_id.items(), key=lambda kv: kv[1][0], reverse=True)
        return [(sid, names) for sid, (_, names) in ordered]

    session = mgr.comm.session("restore")
    try:
        found = decide(
            mgr.comm,
            session,
            "candidates",
            lambda: listed([]),
            lambda ranks: PeerLost("listing the snapshots to restore failed", ranks),
        )
    finally:
        session.close()
    by_name = {t.name: t for t in mgr.tier_list}
    return [(sid, [by_name[n] for n in names]) for sid, names in found]


def _gives(state: Any, c: commit.Committed, level: str, allow_downgrade: bool) -> bool:
    if not isinstance(state, TrainState) or allow_downgrade:
        return True
    held = level_rank(str(c.marker.summary.get("level", "weights")))
    return held >= min(level_rank(level), level_rank(state.level_cap()))


def _all_sources(mgr: CheckpointManager, info: SnapshotInfo) -> dict[str, int]:
    """(all ranks) Where every rank's restored bytes came from, summed: the restart log says
    whether a node took its shards from partners."""

    def total(said: Sequence[dict[str, int]]) -> dict[str, int]:
        out: dict[str, int] = {}
        for sources in said:
            for where, nbytes in sources.items():
                out[where] = out.get(where, 0) + int(nbytes)
        return out

    session = mgr.comm.session("restore-sources")
    try:
        return dict(
            all_reduce(
                mgr.comm,
                session,
                "sources",
                lambda: dict(info.sources),
                total,
                lambda ranks: PeerLost("summing the restore's sources failed", ranks),
            )
        )
    finally:
        session.close()


def _log_restart(mgr: CheckpointManager) -> None:
    """(coordinator) One line on what this restart lost and how long it took."""
    if not mgr.comm.is_coordinator:
        return
    runs = restarts.history(lease.events(mgr.storage), lease.progress(mgr.storage)).runs
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
