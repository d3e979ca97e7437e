"""When to save and what to keep: small composable policies. Pure -- no I/O, no torch.

Save policies answer "save at this step?" from what they are told (:class:`StepInfo`); several
given together save when any says so. Retention policies answer "which of these snapshots do I
keep?"; several given together keep what any keeps. The manager adds two rules no policy can
override: the newest committed snapshot and any save in flight are never deleted.

Young (1974) and Daly (2006) give the checkpoint interval that minimises lost work for a save
that blocks for ``cost`` seconds on a machine whose mean time between failures is ``mtbf``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from trainsnap.errors import InvalidArgumentError

# -- intervals ------------------------------------------------------------------------------------


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: sqrt(2 * cost * MTBF), in seconds."""
    _check_positive(cost_s=cost_s, mtbf_s=mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (2006, eq. 37), in seconds of compute between saves.

    sqrt(2 d M) * (1 + sqrt(d / 2M) / 3 + (d / 2M) / 9) - d  for d < 2M, and M otherwise.
    """
    _check_positive(cost_s=cost_s, mtbf_s=mtbf_s)
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - cost_s


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if not (isinstance(v, int | float) and v > 0 and math.isfinite(v)):
            raise InvalidArgumentError(f"{name} must be a positive number of seconds, got {v!r}")


def parse_duration(text: str) -> float:
    """Seconds in ``"90"``, ``"30s"``, ``"5m"``, ``"4h"``, ``"2d"`` or ``"1h30m"``."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    s = text.strip().lower()
    if not s:
        raise InvalidArgumentError("empty duration")
    total, number = 0.0, ""
    for ch in s:
        if ch.isdigit() or ch == ".":
            number += ch
        elif ch in units and number:
            total += float(number) * units[ch]
            number = ""
        else:
            raise InvalidArgumentError(f"cannot read {text!r} as a duration (e.g. 30s, 5m, 4h)")
    if number:
        total += float(number)
    return total


# -- when to save ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepInfo:
    """What a save policy may look at."""

    step: int
    now: float
    """Seconds on the deciding rank's monotonic clock."""
    last_save_step: int | None
    last_save_time: float | None
    save_costs: Sequence[float] = ()
    """Blocking seconds of recent saves, oldest first."""
    step_times: Sequence[float] = ()
    """Seconds of recent training steps, oldest first."""
    mtbf_observed: float | None = None


class SavePolicy(Protocol):
    shared: bool
    """True when the decision depends on this rank's clock or measurements: the coordinator's
    decision is then shared with every rank. False when every rank decides the same alone."""

    def should_save(self, info: StepInfo) -> bool: ...


@dataclass(frozen=True, slots=True)
class Every:
    """Save every ``steps`` steps, or every ``seconds`` seconds (or both: whichever comes first)."""

    steps: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if self.steps is None and self.seconds is None:
            raise InvalidArgumentError("Every needs steps= or seconds=")
        if self.steps is not None and self.steps < 1:
            raise InvalidArgumentError(f"Every(steps=...) must be >= 1, got {self.steps}")
        if self.seconds is not None and not self.seconds > 0:
            raise InvalidArgumentError(f"Every(seconds=...) must be > 0, got {self.seconds}")

    @property
    def shared(self) -> bool:
        return self.seconds is not None

    def should_save(self, info: StepInfo) -> bool:
        if self.steps is not None and info.step % self.steps == 0:
            return True
        if self.seconds is not None:
            if info.last_save_time is None:
                return False
            return info.now - info.last_save_time >= self.seconds
        return False


@dataclass(frozen=True, slots=True)
class YoungDaly:
    """Save at Daly's optimal interval, from the measured blocking cost of recent saves and the
    measured step time. ``mtbf`` in seconds; None uses the MTBF observed across the root's
    restarts (from its restart log), or ``default_mtbf`` before any was observed."""

    mtbf: float | None = None
    default_mtbf: float = 24 * 3600.0
    first_after_steps: int = 100
    """Steps before the first save, while nothing has been measured."""

    shared = True

    def interval_steps(self, info: StepInfo) -> int | None:
        mtbf = self.mtbf or info.mtbf_observed or self.default_mtbf
        if not info.save_costs or not info.step_times:
            return None
        cost = statistics.median(info.save_costs[-5:])
        step_time = statistics.median(info.step_times[-50:])
        if cost <= 0 or step_time <= 0:
            return 1
        return max(1, round(daly_interval(cost, mtbf) / step_time))

    def should_save(self, info: StepInfo) -> bool:
        since = info.step - (info.last_save_step if info.last_save_step is not None else -1)
        interval = self.interval_steps(info)
        if interval is None:
            return since >= self.first_after_steps
        return since >= interval


@dataclass(frozen=True, slots=True)
class When:
    """A user predicate on the step info, evaluated by every rank at every step: it must answer
    alike on every rank (a function of ``info.step``, or of values every rank shares). A
    decision on a clock or a measurement belongs in ``Every(seconds=...)`` or ``YoungDaly``,
    which are decided once and shared; a predicate is not, so it saves at exactly the steps it
    names."""

    predicate: Callable[[StepInfo], bool]
    shared = False

    def should_save(self, info: StepInfo) -> bool:
        return bool(self.predicate(info))


def as_save_policies(interval: object) -> list[SavePolicy]:
    if interval is None:
        return []
    items = list(interval) if isinstance(interval, list | tuple) else [interval]
    out: list[SavePolicy] = []
    for p in items:
        if callable(p) and not hasattr(p, "should_save"):
            out.append(When(p))
        elif hasattr(p, "should_save"):
            out.append(p)  # type: ignore[arg-type]
        else:
            raise InvalidArgumentError(
                f"interval= takes Every, YoungDaly, a predicate or a list of them, got {p!r}"
            )
    return out


# -- what to keep ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidate:
    """A committed snapshot as retention sees it."""

    id: str
    step: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    tags: tuple[str, ...] = ()


class Retention(Protocol):
    def keep(self, snapshots: Sequence[Candidate]) -> set[str]: ...


@dataclass(frozen=True, slots=True)
class KeepLast:
    """The ``n`` newest snapshots."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise InvalidArgumentError(f"KeepLast(n) needs n >= 1, got {self.n}")

    def keep(self, snapshots: Sequence[Candidate]) -> set[str]:
        newest = sorted(snapshots, key=lambda c: c.step)[-self.n :]
        return {c.id for c in newest}


@dataclass(frozen=True, slots=True)
class KeepEvery:
    """Snapshots whose step is a multiple of ``steps`` (the newest one per multiple)."""

    steps: int

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise InvalidArgumentError(f"KeepEvery(steps) needs steps >= 1, got {self.steps}")

    def keep(self, snapshots: Sequence[Candidate]) -> set[str]:
        best: dict[int, Candidate] = {}
        for c in snapshots:
            if c.step % self.steps == 0:
                best[c.step] = c  # sorted input: the last of equal steps wins
        return {c.id for c in best.values()}


@dataclass(frozen=True, slots=True)
class KeepBest:
    """The ``n`` snapshots with the best value of ``metric`` (``mode`` "min" or "max")."""

    metric: str
    mode: str = "min"
    n: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise InvalidArgumentError(f"KeepBest mode must be 'min' or 'max', got {self.mode!r}")
        if self.n < 1:
            raise InvalidArgumentError(f"KeepBest(n) needs n >= 1, got {self.n}")

    def keep(self, snapshots: Sequence[Candidate]) -> set[str]:
        scored = [
            c
            for c in snapshots
            if isinstance(c.metrics.get(self.metric), int | float)
            and math.isfinite(c.metrics[self.metric])
        ]
        sign = 1.0 if self.mode == "min" else -1.0
        scored.sort(key=lambda c: (sign * float(c.metrics[self.metric]), -c.step))
        return {c.id for c in scored[: self.n]}


@dataclass(frozen=True, slots=True)
class KeepTagged:
    """Snapshots saved with a tag (any tag, or one of ``tags``): pinned."""

    tags: tuple[str, ...] = ()

    def keep(self, snapshots: Sequence[Candidate]) -> set[str]:
        return {
            c.id for c in snapshots if c.tags and (not self.tags or set(c.tags) & set(self.tags))
        }


def as_retention(retention: object) -> list[Retention]:
    if retention is None:
        return []
    items = list(retention) if isinstance(retention, list | tuple) else [retention]
    for p in items:
        if not hasattr(p, "keep"):
            raise InvalidArgumentError(
                f"retention= takes KeepLast, KeepEvery, KeepBest, KeepTagged or a list, got {p!r}"
            )
    return items  # type: ignore[return-value]


def to_delete(
    snapshots: Iterable[Candidate], policies: Sequence[Retention], protected: set[str]
) -> list[Candidate]:
    """The snapshots no policy keeps, except the newest and the protected; oldest first.

    With no policy everything is kept. Tagged snapshots are always kept (pinned).
    """
    cands = sorted(snapshots, key=lambda c: c.step)
    if not policies or not cands:
        return []
    keep = set(protected) | {cands[-1].id} | KeepTagged().keep(cands)
    for p in policies:
        keep |= p.keep(cands)
    return [c for c in cands if c.id not in keep]
