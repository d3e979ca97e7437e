"""The save protocol across ranks (one process is the case of a world of one).

Every rank calls :func:`run_save` (or :func:`prepare_save`, then :func:`finish_save` on any
thread, for an asynchronous save):

1. (all ranks) capture the state and describe it: tensor entries (key, dtype, global shape,
   region, size), values (encoded), digests of plain tensors that may be replicas.
2. (coordinator) gather the descriptions and plan: same step everywhere, same dtype and shape
   per key, shards that tile every tensor, replicas written once by balanced writers, values
   identical everywhere stored once. A refusal reaches every rank and nothing is written.
3. (all ranks) stage and write the assigned payloads as content-addressed objects; report them
   (or the error). No collective on the training process group: the control plane is the
   rendezvous store (:mod:`trainsnap.protocol.control_plane`). A large report is written to
   storage and only its size and digest sent (:mod:`trainsnap.protocol.write_reports`).
4. (coordinator) gather the reports (reading and checking the stored ones). A rank that failed,
   died or went silent, or whose stored report is missing or changed, means no commit;
   otherwise assemble the manifest and commit it through the save's committer
   (:class:`~trainsnap.protocol.commit.Committer`; the direct one writes the manifest, then the
   marker).
5. (all ranks) learn the outcome: the snapshot, or one error listing every failing rank. The
   coordinator then deletes the stored reports; every rank then settles the commit (nothing
   for a direct commit; copies and every node's marker for a replicated one).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from trainsnap import trace, tunables
from trainsnap.engine.gc_pause import paused_gc
from trainsnap.engine.staging import BudgetExceeded, Lease, StagingPool
from trainsnap.errors import CommitFailedError, InvalidArgumentError, RankErrors, TrainsnapError
from trainsnap.format.checksums import Hasher
from trainsnap.format.manifest import Manifest
from trainsnap.protocol import commit, write_reports
from trainsnap.protocol.assemble import assemble
from trainsnap.protocol.collective import all_reduce, reduce_scatter
from trainsnap.protocol.control_plane import Comm, PeerLost, Session
from trainsnap.protocol.outcome import Outcome, describe_error
from trainsnap.protocol.planner import (
    Assignment,
    Channel,
    RankMeta,
    SavePlan,
    layout_digest,
    plan_cached,
    plan_local,
)
from trainsnap.protocol.rank_save import Local, SaveRequest, WriteReport, describe, write_assigned
from trainsnap.protocol.snapshot_info import SnapshotInfo
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)


def _refusal(problems: list[str]) -> TrainsnapError:
    return InvalidArgumentError(
        "the save was refused before anything was written: the ranks' states do not make one "
        "consistent snapshot",
        problems=problems,
    )


@dataclass(slots=True)
class SaveResult:
    manifest: Manifest | None
    outcome: Outcome
    bytes_new: int
    seconds: float
    pause: float = 0.0
    """Seconds the caller was blocked (the whole save when synchronous)."""

    def info(self, root: str) -> SnapshotInfo:
        """The committed snapshot, as the public API returns it."""
        if self.manifest is not None:
            return SnapshotInfo.from_manifest(self.manifest, root)
        return SnapshotInfo.from_summary(
            self.outcome.snapshot_id, self.outcome.manifest_summary, root
        )


@dataclass(slots=True, kw_only=True)
class PendingSave:
    """A save past its agreement and plan (and, when asynchronous, its staging): what is left
    is writing and committing, which :func:`finish_save` does, on any thread."""

    storage: Storage
    opts: SaveRequest
    comm: Comm
    session: Session
    hasher: Hasher
    local: Local
    assignment: Assignment
    metas: list[RankMeta] | None
    plan: SavePlan | None
    mesh: dict[str, int]
    t0: float
    pause: float = 0.0
    """Seconds from ``t0`` until the caller could go on (agreement, plan, staging)."""
    lease: Lease | None = None
    waited: float = 0.0
    """Seconds the caller waited for earlier saves before this one began (before ``t0``)."""

    @property
    def snapshot_id(self) -> str:
        return self.assignment.snapshot_id


def run_save(state: Any, storage: Storage, opts: SaveRequest, comm: Comm) -> SaveResult:
    """A synchronous save: every step on the calling thread (the garbage collector paused,
    see :mod:`trainsnap.engine.gc_pause`)."""
    with paused_gc():
        return finish_save(prepare_save(state, storage, opts, comm, pool=None))


def prepare_save(
    state: Any, storage: Storage, opts: SaveRequest, comm: Comm, pool: StagingPool | None
) -> PendingSave:
    """Steps 1 and 2, then staging into ``pool`` when given (an asynchronous save): once this
    returns, the caller may change its tensors."""
    t0 = time.perf_counter()
    hasher = Hasher(opts.options.checksum, tunables.get().block_size)
    session = comm.session("save")
    try:
        with paused_gc():  # the pause of an asynchronous save: see trainsnap.engine.gc_pause
            pending = _agree(state, storage, opts, comm, session, hasher, t0)
        if pool is not None:
            with trace.span("stage", step=opts.step) as ev:
                pending.lease = _stage(pending, pool)
                ev["bytes"] = pending.lease.nbytes if pending.lease else 0
        try:
            opts.committer.prepared(pending)
        except BaseException:
            if pool is not None and pending.lease is not None:
                pool.release(pending.lease)
            raise
        pending.pause = time.perf_counter() - t0
        return pending
    except BaseException:
        session.close()
        raise


def _agree(
    state: Any,
    storage: Storage,
    opts: SaveRequest,
    comm: Comm,
    session: Session,
    hasher: Hasher,
    t0: float,
) -> PendingSave:
    # 1. (all ranks) describe
    with trace.span("capture", step=opts.step):
        local, meta, mesh = _capture(state, storage, opts, comm, hasher)
    # 2. (coordinator) plan; (all ranks) each its assignment
    with trace.span("plan", step=opts.step):
        sid = commit.new_snapshot_id(opts.step)
        planned: list[tuple[SavePlan, list[RankMeta]]] = []

        def plan(metas: list[Any]) -> list[Assignment]:  # RankMeta, by rank; [None] alone
            if comm.world_size == 1:
                assert local is not None
                made = plan_local(local.entries, local.values, opts.step, sid, local.captured.tree)
            else:
                made = _planned(metas, sid, storage, comm)
            planned.append((made, made.metas or metas))  # in full, where ranks sent a digest
            return made.assignments

        lost = partial(_not_planned, opts.step)
        assignment: Assignment = reduce_scatter(comm, session, "meta", lambda: meta, plan, lost)
    channel = _channel(storage, comm, comm.rank)
    if assignment.problems:
        comm.plans.sent.pop(channel, None)  # the next save sends the layout in full
        raise _refusal(assignment.problems)
    assert local is not None
    if meta is not None:
        comm.plans.sent[channel] = meta.layout
    whole, metas = planned[0] if planned else (None, None)
    return PendingSave(
        storage=storage,
        opts=opts,
        comm=comm,
        session=session,
        hasher=hasher,
        local=local,
        assignment=assignment,
        metas=metas,
        plan=whole,
        mesh=mesh,
        t0=t0,
    )


def _capture(
    state: Any, storage: Storage, opts: SaveRequest, comm: Comm, hasher: Hasher
) -> tuple[Local | None, RankMeta | None, dict[str, int]]:
    """Step 1 (all ranks): the rank's state and what the planner is sent of it (nothing in a
    world of one). A rank that cannot describe its state tells the planner why, which makes it
    one of the refusal's problems on every rank; alone, it raises its error as it is."""
    try:
        local = describe(state, opts, hasher, replica_digests=comm.world_size > 1)
        meta = _rank_meta(local, storage, comm, opts.step) if comm.world_size > 1 else None
    except TrainsnapError as e:
        if comm.world_size == 1:
            raise
        return None, RankMeta(comm.rank, opts.step, error=describe_error(e)), {}
    return local, meta, local.captured.mesh


def _planned(metas: list[RankMeta], sid: str, storage: Storage, comm: Comm) -> SavePlan:
    """Step 2 (coordinator) of a world of more than one: a planner bug must not leave the other
    ranks waiting, so it is every rank's refusal."""
    try:
        return _coordinator_plan(metas, sid, storage, comm)
    except Exception as e:
        log.exception("planning snapshot %s failed", sid)
        why = [f"planner: {describe_error(e)}"]
        return SavePlan([Assignment(problems=why) for _ in metas], [], {})


def _not_planned(step: int, ranks: RankErrors) -> TrainsnapError:
    return PeerLost(
        f"save of step {step} was not planned: {len(ranks)} rank(s) did not describe their "
        "state; nothing was written",
        ranks,
    )


# -- cached plans ---------------------------------------------------------------------------------


def _channel(storage: Storage, comm: Comm, rank: int) -> Channel:
    return (storage.url, comm.world_size, comm.coordinator, rank)


def _rank_meta(local: Local, storage: Storage, comm: Comm, step: int) -> RankMeta:
    """This rank's description; only a digest of it when its layout is the one it last sent."""
    meta = local.meta(comm.rank, step)
    meta.layout = layout_digest(meta)
    if comm.plans.sent.get(_channel(storage, comm, comm.rank)) == meta.layout:
        return RankMeta(comm.rank, step, [], meta.values, layout=meta.layout, cached=True)
    return meta


def _coordinator_plan(metas: list[RankMeta], sid: str, storage: Storage, comm: Comm) -> SavePlan:
    channel, memory = _channel(storage, comm, -1), comm.plans
    cache = memory.plans.get(channel)
    plan, kept = plan_cached(metas, sid, cache)
    memory.counts["digests_received"] += sum(m.cached for m in metas)
    memory.keep(channel, kept, reused=kept is not None and kept is cache)
    return plan


def _stage(pending: PendingSave, pool: StagingPool) -> Lease | None:
    """Copy what this rank writes into pool buffers. Values are already bytes of their own.
    A save larger than the pool's budget is not staged: it will be written synchronously."""
    tensors = pending.local.captured.tensors
    sizes = [pending.local.entries[i].nbytes for i, _ in pending.assignment.entries]
    try:
        pool.check_fits(sizes)
    except BudgetExceeded as e:
        log.warning("snapshot %s is saved synchronously: %s", pending.snapshot_id, e)
        return None
    lease = Lease()
    try:
        which = [i for i, _scope in pending.assignment.entries]
        views = pool.stage_many([tensors[i].local for i in which], lease)
        for i, view in zip(which, views, strict=True):
            pending.local.staged[i] = (view, tensors[i].local)
    except BudgetExceeded as e:  # the pool's buffers in use cannot make room: write from the state
        pool.release(lease)
        log.warning("snapshot %s is saved synchronously: %s", pending.snapshot_id, e)
        return None
    except BaseException:
        pool.release(lease)
        raise
    return lease


def finish_save(pending: PendingSave) -> SaveResult:
    """Steps 3 to 5: write, report, commit, learn the outcome. Closes the session."""
    try:
        return _finish(pending)
    finally:
        pending.session.close()


def _finish(pending: PendingSave) -> SaveResult:
    comm, opts, sid = pending.comm, pending.opts, pending.snapshot_id
    if pending.lease is not None:
        pending.lease.wait_copies()
    # 3. (all ranks) write
    with trace.span("write", step=opts.step) as ev:
        report = _write(pending)
        ev["bytes"] = report.bytes_new
    # 4. (coordinator) gather reports, commit; 5. (all ranks) learn the outcome
    with trace.span("commit", step=opts.step):
        manifest, outcome = _report_and_commit(pending, report)
    if not outcome.ok:
        raise _not_committed(opts.step, sid, outcome.rank_errors)
    opts.committer.settle(pending, report, manifest)  # nothing for a direct commit
    dt = time.perf_counter() - pending.t0
    # Phases, each measured from the same clock readings: wait + pause + drain == seconds.
    pause = min(pending.pause, dt) if pending.lease is not None else dt
    if comm.is_coordinator:
        _log_saved(pending, outcome, pause, dt)
    if opts.on_commit is not None:
        try:
            opts.on_commit(sid, manifest, int(outcome.manifest_summary.get("bytes_new", 0)))
        except Exception:  # housekeeping must not turn a committed save into a failure
            log.exception("post-commit housekeeping of snapshot %s failed", sid)
    return SaveResult(manifest, outcome, report.bytes_new, dt, pause)


def _write(pending: PendingSave) -> WriteReport:
    """Step 3 (all ranks): this rank's report, or its error to report (raised as the save's
    failure in a world of one)."""
    try:
        return write_assigned(pending.storage, pending.hasher, pending.local, pending.assignment)
    except Exception as e:  # reported to the coordinator, raised everywhere after step 4
        if pending.comm.world_size == 1:
            raise CommitFailedError(
                f"save of step {pending.opts.step} failed while writing: {describe_error(e)}; "
                "nothing was committed",
                snapshot_id=pending.snapshot_id,
                rank_errors={0: describe_error(e)},
            ) from e
        return WriteReport(error=describe_error(e))


def _report_and_commit(
    pending: PendingSave, report: WriteReport
) -> tuple[Manifest | None, Outcome]:
    """Steps 4 and 5: every rank's report to the coordinator, which commits or not; the outcome
    on every rank. A rank lost meanwhile is a failed rank; the coordinator lost after the
    reports were sent leaves its marker to say whether it committed."""
    comm, storage, sid = pending.comm, pending.storage, pending.snapshot_id
    committed: list[Manifest | None] = [None]
    stored: list[str] = []

    def send() -> Any:  # the coordinator's own report stays here: it sends nothing
        return (
            None
            if comm.is_coordinator
            else write_reports.outgoing(
                storage, sid, comm.rank, report, inline=pending.opts.committer.reports_inline
            )
        )

    def commit_all(messages: list[Any]) -> Outcome:
        reports, read = write_reports.incoming(storage, sid, messages, comm.rank, report)
        stored.extend(read)
        committed[0], outcome = _commit(pending, reports)
        return outcome

    failed = partial(_not_committed, pending.opts.step, sid)
    try:
        outcome: Outcome = all_reduce(comm, pending.session, "report", send, commit_all, failed)
    except PeerLost as e:
        if comm.is_coordinator:
            outcome = Outcome(sid, rank_errors=e.ranks)
        else:
            outcome = _outcome_without_coordinator(storage, sid, e)
    if comm.is_coordinator and comm.world_size > 1:
        write_reports.discard(storage, sid, stored, committed=outcome.ok)
    return committed[0], outcome


def _not_committed(step: int, sid: str, rank_errors: RankErrors) -> TrainsnapError:
    return CommitFailedError(
        f"save of step {step} (snapshot {sid}) was not committed: "
        f"{len(rank_errors)} rank(s) failed; the previous snapshots are untouched",
        snapshot_id=sid,
        rank_errors=rank_errors,
    )


def _log_saved(pending: PendingSave, outcome: Outcome, pause: float, dt: float) -> None:
    s = outcome.manifest_summary
    referenced, new = int(s["nbytes"]), int(s["bytes_new"])
    log.info(
        "saved snapshot %s step=%d bytes=%d written=%d reused=%d dedup=%.1f%% ranks=%d "
        "wait=%.3f pause=%.3f drain=%.3f seconds=%.3f MBps=%.1f root=%s",
        pending.snapshot_id,
        pending.opts.step,
        referenced,
        new,
        referenced - new,
        100.0 * (referenced - new) / max(referenced, 1),
        pending.comm.world_size,
        pending.waited,
        pause,
        dt - pause,
        pending.waited + dt,
        referenced / max(dt, 1e-9) / 1e6,
        pending.storage.url,
    )


def _commit(pending: PendingSave, reports: list[WriteReport]) -> tuple[Manifest | None, Outcome]:
    """Step 4 (coordinator): every report in, or no commit."""
    comm, sid = pending.comm, pending.snapshot_id
    errors = {r: rep.error for r, rep in enumerate(reports) if rep.error}
    if errors:
        return None, Outcome(sid, rank_errors=errors)
    assert pending.metas is not None and pending.plan is not None
    topology = {
        "world_size": comm.world_size,
        "coordinator": comm.coordinator,
        "mesh": pending.mesh,
    }
    try:
        manifest = assemble(
            sid, pending.opts, pending.hasher, pending.metas, pending.plan, reports, topology
        )
        pending.opts.committer.write(
            pending.storage, manifest, {"world_size": comm.world_size}, pending.opts.fence
        )
    except Exception as e:
        log.exception("commit of snapshot %s failed", sid)
        return None, Outcome(sid, rank_errors={comm.rank: f"commit: {describe_error(e)}"})
    new = sum(r.bytes_new for r in reports)
    summary = {**manifest.summary(), "bytes_new": new}
    return manifest, Outcome(sid, manifest_summary=summary)


def _outcome_without_coordinator(storage: Storage, sid: str, error: PeerLost) -> Outcome:
    """The coordinator went silent after we reported. If its marker exists the snapshot is
    committed (it died after committing); otherwise it is not, and never will be."""
    try:
        marker = commit.committed_marker(storage, sid)
    except TrainsnapError:
        return Outcome(
            sid, rank_errors={r: f"coordinator: {why}" for r, why in error.ranks.items()}
        )
    return Outcome(sid, manifest_summary={**marker.summary, "bytes_new": 0})
