"""Every run and restart of a job, from its restart log: how far each run got, how much work a
restart lost, how long it was down, and the goodput of the whole job. Pure: it reads event
dictionaries (:func:`trainsnap.manager.lease.events`) and progress records
(:func:`trainsnap.manager.lease.progress`), and does no I/O.

Definitions (all times are wall-clock seconds from the events):

* A run is one writer generation. It ends in ``close``, ``preempt`` (a clean stop),
  ``superseded`` (a newer job took the root over while it still ran: it recorded a sign of life
  after the next run started, or the next run saw it alive), or ``crash`` (its last event is
  anything else). The newest run, without a clean end, is ``running``: it may still run, or it
  exited without ``close()``; it is not counted as a crash, in the table or in the totals, until
  a newer run follows it.
* The step a run *reached* is the last step whose ``CheckpointManager.step`` returned
  (:mod:`trainsnap.manager.progress`), as far as the log knows it: the highest step of its
  progress record (written at every save and at most every ``ManagerOptions.progress_seconds``),
  its saves, its restore, its preemption and its ``close`` (which records the step reached), and
  never below the step the next run restored (that snapshot was committed, so its step was
  reached: a memory tier's saves are not in the log). It is exact when the run ended with
  ``close`` or a preemption (their events carry the step) or recorded every step
  (``progress_seconds=0``), and otherwise a lower bound (``reach_is_lower_bound``).
* The *lost work* of a restart: the step the previous run reached minus the step restored, and
  the training seconds between the save of the restored step and the previous run's last
  progress. Exact when the previous run's reach is, and otherwise a lower bound
  (``lost_is_lower_bound``): the run may have gone on for up to ``progress_seconds`` after its
  last record.
* *Restore* seconds: resolving, reading, verifying and applying the snapshot (the restore's
  own RTO, from its start to its end); *since start*: from the process's start to the restore
  done; *to first step*: from the restore done to the first completed step after it. The
  *RTO from the last record*: from the previous run's last sign of life (its last progress
  record or event) to the restore done: the whole outage as far as the log can see it (the
  previous run may have died up to ``progress_seconds`` after its last record).
* Where a restart restored *from* (:data:`FROM`): the nodes' own memory, a partner's memory
  (some node took bytes of its shards from another node's memory: a replaced or wiped node),
  the local disk tier or the durable root.
* *Goodput*: the share of the job's wall time that was neither down (between a run's last sign of
  life and the next run's first step) nor lost work.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from trainsnap.manager.policies import daly_interval, young_interval

CLEAN_ENDS = ("close", "preempt")
ENDS = (*CLEAN_ENDS, "superseded", "crash", "running")
_NODE, _PARTNER = "memory (this node)", "memory (partner node)"
"""The names :attr:`trainsnap.SnapshotInfo.sources` gives the memory tier's two sources (the
restore event records them): the history says where a restore read from in the same words."""
FROM = (_NODE, _PARTNER, "local disk", "durable")
"""Where a restore read its snapshot from, nearest first."""


@dataclass(slots=True)
class Run:
    """One writer generation of the job."""

    generation: int
    started: float
    ended: float
    end: str
    """One of :data:`ENDS`."""
    step_reached: int | None = None
    time_reached: float | None = None
    reach_is_lower_bound: bool = True
    """The run may have gone past ``step_reached``: it recorded neither every step nor its end."""
    restored_step: int | None = None
    restored_snapshot: str | None = None
    restored_at: float | None = None
    level: str | None = None
    restored_from: str | None = None
    """One of :data:`FROM` (None: an older log that did not say)."""
    partner_bytes: int | None = None
    """Bytes the restore fetched from partners' memory (memory tier only)."""
    restore_seconds: float | None = None
    since_start_seconds: float | None = None
    to_first_step_seconds: float | None = None
    lost_steps: int | None = None
    lost_seconds: float | None = None
    lost_is_lower_bound: bool = False
    """The previous run may have gone further than its last progress record said."""
    rto_seconds: float | None = None
    """From the previous run's last sign of life to this run's restore done."""
    progress_seconds: float | None = None
    """How often this run recorded its progress (None: not recorded, an older log)."""
    saves: list[tuple[float, int]] = field(default_factory=list)
    save_pauses: list[float] = field(default_factory=list)


@dataclass(slots=True)
class History:
    """The job's runs and what they add up to."""

    runs: list[Run]
    wall_seconds: float
    down_seconds: float
    lost_seconds: float
    goodput: float | None
    mean_lost_steps: float | None
    mean_lost_seconds: float | None
    mtbf_seconds: float | None
    crashes: int
    save_cost_seconds: float | None
    young_seconds: float | None
    daly_seconds: float | None
    interval_in_use: str | None

    def as_dict(self) -> dict[str, Any]:
        """Plain data for strict JSON: a number that is not finite becomes None."""
        out: dict[str, Any] = _finite(asdict(self))
        return out


def history(
    events: Sequence[Mapping[str, Any]], progress: Mapping[int, Mapping[str, Any]]
) -> History:
    """The runs in ``events`` (any order), with ``progress`` by generation. Events without a
    numeric time, an int generation and a str kind are ignored. O(events log events)."""
    by_generation = _by_generation(events)
    runs = [_run(gen, evs, progress.get(gen)) for gen, evs in sorted(by_generation.items())]
    taken_over = {
        _int(e.get("previous_generation"))
        for evs in by_generation.values()
        for e in evs
        if e["kind"] == "takeover"
    }
    for previous, run in itertools.pairwise(runs):
        if previous.end == "crash" and (
            previous.ended > run.started or previous.generation in taken_over
        ):
            previous.end = "superseded"  # alive when the next job took over: not a crash
    if runs and runs[-1].end == "crash":
        runs[-1].end = "running"
    saved_at = {
        str(e.get("snapshot")): float(e["time"])
        for evs in by_generation.values()
        for e in evs
        if e["kind"] == "save"
    }
    for previous, run in itertools.pairwise(runs):
        _lost_work(previous, run, saved_at)
    return _totals(runs, [e for evs in by_generation.values() for e in evs])


def _by_generation(events: Sequence[Mapping[str, Any]]) -> dict[int, list[Mapping[str, Any]]]:
    out: dict[int, list[Mapping[str, Any]]] = {}
    for event in events:
        when, generation = _float(event.get("time")), _int(event.get("generation", 0))
        if when is not None and generation is not None and isinstance(event.get("kind"), str):
            out.setdefault(generation, []).append(event)
    for evs in out.values():
        evs.sort(key=lambda e: float(e["time"]))
    return out


def _run(generation: int, evs: list[Mapping[str, Any]], progress: Mapping[str, Any] | None) -> Run:
    last = evs[-1]["kind"]
    if last == "close" and any(e["kind"] == "preempt" for e in evs):
        last = "preempt"  # stopped by a preemption signal, after saving
    run = Run(
        generation,
        float(evs[0]["time"]),
        float(evs[-1]["time"]),
        last if last in CLEAN_ENDS else "crash",
    )
    reached: list[tuple[int, float]] = []
    for event in evs:
        kind, when = event["kind"], float(event["time"])
        if kind == "start":
            run.progress_seconds = _float(event.get("progress_seconds"))
            every_step = event.get("progress", "every step") == "every step"
            run.reach_is_lower_bound = not (every_step and run.progress_seconds == 0)
        elif kind == "restore":
            run.restored_step, run.restored_at = _int(event.get("step")), when
            run.restored_snapshot, run.level = _str(event.get("snapshot")), _str(event.get("level"))
            run.restore_seconds = _float(event.get("seconds"))
            run.restored_from, run.partner_bytes = _restored_from(event)
            run.since_start_seconds = _float(event.get("since_start"))
        elif kind == "first_step":
            run.to_first_step_seconds = _float(event.get("seconds"))
        elif kind == "save" and _int(event.get("step")) is not None:
            run.saves.append((when, int(event["step"])))
            if _float(event.get("pause")) is not None:
                run.save_pauses.append(float(event["pause"]))
        if _int(event.get("step")) is not None and kind in ("save", "restore", "preempt", "close"):
            reached.append((int(event["step"]), when))
            if kind in CLEAN_ENDS:
                run.reach_is_lower_bound = False  # the end event names the step reached
    last_step = _int(progress.get("step")) if progress else None
    last_time = _float(progress.get("time")) if progress else None
    if last_step is not None and last_time is not None:
        reached.append((last_step, last_time))
        run.ended = max(run.ended, last_time)
    if reached:
        run.step_reached, run.time_reached = max(reached)
    return run


def _restored_from(event: Mapping[str, Any]) -> tuple[str | None, int | None]:
    """(:data:`FROM` entry, bytes from partners' memory) of a restore event."""
    tier = event.get("tier")
    if tier == "local":
        return "local disk", None
    if tier == "durable":
        return "durable", None
    if tier != "memory":
        return None, None
    sources = event.get("sources")
    partner = _int(sources.get(_PARTNER)) if isinstance(sources, Mapping) else None
    return (_PARTNER if partner else _NODE), partner


def _lost_work(previous: Run, run: Run, saved_at: Mapping[str, float]) -> None:
    if run.restored_at is not None and previous.end != "superseded":  # not an outage
        run.rto_seconds = max(0.0, run.restored_at - previous.ended)
    if run.restored_step is None:
        return
    saved = saved_at.get(str(run.restored_snapshot))
    if previous.step_reached is None or previous.step_reached < run.restored_step:
        # The restored snapshot was committed before this run started: its step was reached.
        previous.step_reached = run.restored_step
        previous.time_reached = saved if saved is not None else previous.time_reached
    run.lost_steps = previous.step_reached - run.restored_step
    run.lost_is_lower_bound = previous.reach_is_lower_bound
    if run.lost_steps == 0:
        run.lost_seconds = 0.0
    elif saved is not None and previous.time_reached is not None:
        run.lost_seconds = max(0.0, previous.time_reached - saved)


def _totals(runs: list[Run], events: Sequence[Mapping[str, Any]]) -> History:
    wall = (max(r.ended for r in runs) - min(r.started for r in runs)) if runs else 0.0
    down = 0.0
    for previous, run in itertools.pairwise(runs):
        back = (run.restored_at or run.started) + (run.to_first_step_seconds or 0.0)
        down += max(0.0, back - previous.ended)
    restarts = [r for r in runs[1:] if r.lost_steps is not None]
    lost = sum(r.lost_seconds or 0.0 for r in restarts)
    crashes = sum(1 for r in runs if r.end == "crash")  # the table's own count
    uptime = sum(r.ended - r.started for r in runs)
    mtbf = uptime / crashes if crashes else None
    pauses = [p for r in runs for p in r.save_pauses]
    cost = statistics.median(pauses) if pauses else None
    starts = [e for e in events if e.get("kind") == "start" and e.get("interval")]
    starts.sort(key=lambda e: float(e["time"]))
    return History(
        runs=runs,
        wall_seconds=wall,
        down_seconds=down,
        lost_seconds=lost,
        goodput=(wall - down - lost) / wall if wall > 0 else None,
        mean_lost_steps=_mean([r.lost_steps for r in restarts]),
        mean_lost_seconds=_mean([r.lost_seconds for r in restarts]),
        mtbf_seconds=mtbf,
        crashes=crashes,
        save_cost_seconds=cost,
        young_seconds=young_interval(cost, mtbf) if cost and mtbf else None,
        daly_seconds=daly_interval(cost, mtbf) if cost and mtbf else None,
        interval_in_use=str(starts[-1]["interval"]) if starts else None,
    )


def _mean(values: list[Any]) -> float | None:
    known = [float(v) for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _int(value: Any) -> int | None:
    """``value`` if it is an int (not a bool) that fits 64 bits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63:
        return value
    return None


def _float(value: Any) -> float | None:
    """``value`` as a finite float, if it is a number."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            return None
        return number if math.isfinite(number) else None
    return None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
