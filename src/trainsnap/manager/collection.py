"""Deleting snapshots and collecting garbage, without ever breaking a retained snapshot.

Deleting a snapshot removes its marker first: a half-deleted snapshot is simply uncommitted,
never a committed one with parts missing. Objects are collected by mark and sweep: everything
referenced by a committed snapshot is kept; an unreferenced object is deleted only if it is
older than a grace period -- a save in flight writes (or, when it reuses an object, refreshes)
its objects before it commits, so the grace period protects them. When no writer holds the root
(its lease was released) there is nothing in flight and everything unreferenced goes at once.
If any committed snapshot's manifest cannot be read, nothing is collected: its references are
unknown. The write reports a save left in a committed snapshot's directory (its coordinator died
before deleting them: :mod:`trainsnap.protocol.write_reports`) are not part of the snapshot and
go once past the grace period.

A manager that holds the root's lease is its only writer, and collects with ``grace=None`` and
its :class:`~trainsnap.manager.housekeeping.SaveGate`: nothing waits out a grace period, and
deletion stops as soon as one of its saves is in flight (see that module for why).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from trainsnap import faults
from trainsnap.errors import TrainsnapError
from trainsnap.manager import lease
from trainsnap.manager.housekeeping import SaveGate
from trainsnap.protocol import commit, write_reports
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GcReport:
    dry_run: bool
    grace: float | None
    snapshots_kept: int = 0
    objects_kept: int = 0
    objects_deleted: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    uncommitted_deleted: list[str] = field(default_factory=list)
    temporaries_deleted: int = 0
    young_skipped: int = 0
    """Unreferenced objects left alone because they are inside the grace period."""
    reports_deleted: int = 0
    """Write reports left in committed snapshots' directories by an interrupted save."""
    interrupted: bool = False
    """A save began while collecting (with a gate): what is left waits for the next collection."""


def collect(
    storage: Storage,
    *,
    grace: float | None = 3600.0,
    dry_run: bool = False,
    gate: SaveGate | None = None,
) -> GcReport:
    """Mark and sweep. ``grace=None`` means: no writer can be active, collect everything
    unreferenced now (callers check the lease first; see :func:`collect_root`) -- or the only
    writer's saves are counted by ``gate``, and every deletion waits until none is in flight and
    none began since the references were read, stopping (``report.interrupted``) otherwise.
    O(snapshots x their objects + objects listed) storage operations."""
    report = GcReport(dry_run=dry_run, grace=grace)
    begun = gate.mark() if gate is not None else 0
    if begun is None:
        report.interrupted = True  # a save in flight: nothing is known to be garbage
        return _done(storage, report)
    problems: list[TrainsnapError] = []
    committed = commit.list_committed(storage, problems)
    if problems:
        raise TrainsnapError(
            f"not collecting {storage.url}: {len(problems)} committed snapshot(s) cannot be read, "
            "so what they reference is unknown. Run `trainsnap verify` and delete or repair them.",
            problems=[str(p) for p in problems],
        )
    referenced: set[str] = set()
    for c in committed:
        referenced.update(commit.open_snapshot(storage, c.snapshot_id).object_names)
    report.snapshots_kept = len(committed)
    now = time.time()

    def old(key: str) -> bool:
        if grace is None:
            return True
        try:
            return now - storage.mtime(key) > grace
        except FileNotFoundError:
            return False

    live = {c.snapshot_id for c in committed}
    for sid in sorted(commit.snapshot_ids(storage) - live):
        keys = list(storage.list(f"snapshots/{sid}/"))
        if keys and all(old(k) for k in keys):  # a commit may be in progress: the grace covers it
            drop = partial(commit.delete_snapshot, storage, sid)
            if not _delete(report, gate, begun, dry_run, drop):
                return _done(storage, report)
            report.uncommitted_deleted.append(sid)
    for sid in sorted(live):
        for key in list(storage.list(write_reports.reports_prefix(sid))):
            if old(key):
                if not _delete(report, gate, begun, dry_run, partial(storage.delete, key)):
                    return _done(storage, report)
                report.reports_deleted += 1
    for key in storage.list("objects/"):
        name = key.rsplit("/", 1)[-1]
        if name in referenced:
            report.objects_kept += 1
            continue
        if not old(key):
            report.young_skipped += 1
            continue
        try:
            size = storage.stat(key)
        except FileNotFoundError:
            continue
        if not _delete(report, gate, begun, dry_run, partial(_delete_object, storage, key)):
            return _done(storage, report)
        report.objects_deleted.append(name)
        report.bytes_freed += size
    if gate is None:  # temporaries of a save in flight are not objects yet: only without one
        report.temporaries_deleted = _temporaries(storage, grace, now, dry_run)
    return _done(storage, report)


def _delete_object(storage: Storage, key: str) -> None:
    faults.point("gc_delete")
    storage.delete(key)


def _delete(
    report: GcReport,
    gate: SaveGate | None,
    begun: int | None,
    dry_run: bool,
    delete: Callable[[], object],
) -> bool:
    """Run ``delete`` (unless a dry run); False, having deleted nothing, when ``gate`` says a
    save is in flight or began since ``begun``."""
    if dry_run:
        return True
    if gate is None:
        delete()
        return True
    with gate.quiet_since(begun) as quiet:
        if quiet:
            delete()
            return True
    report.interrupted = True
    return False


def _done(storage: Storage, report: GcReport) -> GcReport:
    log.info(
        "collected %s: %d object(s), %d bytes, %d uncommitted snapshot(s)%s",
        storage.url,
        len(report.objects_deleted),
        report.bytes_freed,
        len(report.uncommitted_deleted),
        " (dry run)" if report.dry_run else (" (stopped: a save began)" * report.interrupted),
    )
    return report


def _temporaries(storage: Storage, grace: float | None, now: float, dry_run: bool) -> int:
    """Leftover temporary files of interrupted writes (POSIX roots)."""
    import os

    lister = getattr(storage, "list_temporaries", None)
    if lister is None:
        return 0
    n = 0
    for path in list(lister()):
        try:
            if grace is not None and now - os.stat(path).st_mtime <= grace:
                continue
            if not dry_run:
                os.unlink(path)
            n += 1
        except FileNotFoundError:
            continue
    return n


def collect_root(storage: Storage, *, grace: float = 3600.0, dry_run: bool = False) -> GcReport:
    """Collect with the grace period while a writer holds the root, everything otherwise --
    unless the listing is stale: the released writer's newest snapshot must be listed."""
    writer = lease.active_writer(storage)
    if writer is None:
        g = lease.current_generation(storage)
        newest = lease.released_newest(storage, g) if g else None
        if newest is not None and newest not in commit.snapshot_ids(storage):
            raise TrainsnapError(
                f"not collecting {storage.url}: the last writer committed {newest} but the "
                "listing does not show it yet (a lagging listing). Try again later.",
                snapshot_id=newest,
            )
    return collect(storage, grace=grace if writer is not None else None, dry_run=dry_run)
