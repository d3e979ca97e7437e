"""The method protocol, the measurements and the loops that time methods.

A *method* is one way of doing what a benchmark measures (trainsnap's save and load, DCP's, the
disk's raw limit, a memory copy). It has a ``name`` and the operations it supports; the
framework brackets them with ``setup``/``teardown`` and times them:

1. ``setup()`` once, before the first repetition (warm pools, fail early when unavailable).
2. per repetition, in an order rotating from one repetition to the next: ``save(state,
   directory)`` into a fresh directory (timed by the framework; an asynchronous method returns a
   :class:`Pending` whose ``pause`` is what the caller was blocked), then for each load
   ``prepare_load`` (untimed), the page cache evicted, ``load(destination, directory)`` (timed),
   and a bitwise check of the destination where the method places bytes (``verifiable``).
3. ``teardown()`` once, after the last, also after a failure.

Benchmarks that measure configurations rather than methods (a training scenario, a codec, a
simulated world) generate them and measure each (``measure_scenario``, ``measure_codec``,
``run_sim``), with the same loops where they save and load; every benchmark reports through
:mod:`benchmarks._framework.report`: :func:`~benchmarks._framework.report.compare` for a
comparison of methods, :func:`~benchmarks._framework.report.verdicts` for every target.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

State = dict[str, Any]
"""A flat dict of tensors (or DTensors): what a method saves and loads."""

Timer = Callable[[Callable[[], object]], float]
"""Runs an operation and returns its seconds (a wall clock, or one bracketed by barriers)."""


@dataclass
class Pending:
    """An asynchronous save that gave control back to its caller.

    ``pause`` is how long the caller was blocked (until the state may change again); ``details``
    are further seconds the method knows (the call's wall time, when the call returned);
    ``wait`` blocks until the save is durable and returns seconds of its phases, by name.
    """

    pause: float
    wait: Callable[[], dict[str, float]]
    details: dict[str, float] = field(default_factory=dict)


class Method:
    """The protocol every method follows (and the defaults of the optional parts).

    Capabilities are attributes: ``can_save``/``can_load`` say which operations it has;
    ``verifiable`` whether ``load`` places the bytes into the destination (so that the
    framework checks them bit for bit). ``label`` describes it in one line of a report.
    """

    name: str = "method"
    label: str = ""
    can_save: bool = True
    can_load: bool = True
    verifiable: bool = True

    def setup(self) -> None:
        """Before the first repetition."""

    def save(self, state: State, directory: Path) -> Pending | None:
        """Save ``state`` into ``directory``: done on return, or a :class:`Pending` save."""
        raise NotImplementedError(f"{self.name} does not save")

    def prepare_load(self, destination: State, directory: Path) -> None:
        """Untimed work before a load of ``directory`` (before the page cache is evicted)."""

    def load(self, destination: State, directory: Path) -> None:
        """Load the snapshot in ``directory`` into the preallocated ``destination``."""
        raise NotImplementedError(f"{self.name} does not load")

    def teardown(self) -> None:
        """After the last repetition."""


@contextmanager
def set_up(methods: Sequence[Method]) -> Iterator[None]:
    """``setup`` every method now and ``teardown`` every one on exit, whatever happens."""
    started: list[Method] = []
    try:
        for method in methods:
            method.setup()
            started.append(method)
        yield
    finally:
        for method in started:
            method.teardown()


# -- measurements ----------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    present = [value for value in values if not math.isnan(value)]
    return statistics.median(present) if present else math.nan


def _largest(values: Sequence[float]) -> float:
    """The largest value that is not NaN (NaN when all are: a metric no rank recorded)."""
    return max((value for value in values if not math.isnan(value)), default=math.nan)


def wall_time(operation: Callable[[], object]) -> float:
    start = time.perf_counter()
    operation()
    return time.perf_counter() - start


def timed(operation: Callable[[], T]) -> tuple[float, T]:
    """(seconds, result) of one call."""
    start = time.perf_counter()
    result = operation()
    return time.perf_counter() - start, result


def rotated(items: Sequence[T], shift: int) -> list[T]:
    """``items`` rotated left by ``shift``: each repetition starts with the next method."""
    if not items:
        return []
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


class Measurements:
    """Named values (seconds, bytes, fractions) per method, in the order measured (one per
    repetition, or several: a repetition's loads); and the order of the methods in each
    repetition. Missing values are NaN."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, list[float]]] = {}
        self.orders: list[list[str]] = []

    def add(self, method: str, metric: str, value: float | None) -> None:
        series = self.values.setdefault(method, {}).setdefault(metric, [])
        series.append(math.nan if value is None else float(value))

    def add_all(self, method: str, metrics: Mapping[str, float]) -> None:
        for metric, value in metrics.items():
            self.add(method, metric, value)

    def series(self, method: str, metric: str) -> list[float]:
        return self.values.get(method, {}).get(metric, [])

    def median(self, method: str, metric: str) -> float:
        return median(self.series(method, metric))

    def has(self, method: str, metric: str) -> bool:
        return any(not math.isnan(value) for value in self.series(method, metric))

    @property
    def methods(self) -> list[str]:
        return list(self.values)

    def split(self, count: int) -> tuple[Measurements, Measurements]:
        """(the first ``count`` repetitions, the rest): warm-up and timed repetitions apart."""
        first, rest = Measurements(), Measurements()
        for method, metrics in self.values.items():
            for metric, series in metrics.items():
                first.values.setdefault(method, {})[metric] = series[:count]
                rest.values.setdefault(method, {})[metric] = series[count:]
        first.orders, rest.orders = self.orders[:count], self.orders[count:]
        return first, rest

    @staticmethod
    def slowest(per_rank: Sequence[Measurements]) -> Measurements:
        """Per method, metric and repetition, the largest value over the ranks: the time of the
        slowest rank."""
        out = Measurements()
        out.orders = per_rank[0].orders
        for method, metrics in per_rank[0].values.items():
            for metric in metrics:
                columns = zip(*(rank.series(method, metric) for rank in per_rank), strict=True)
                out.values.setdefault(method, {})[metric] = [_largest(c) for c in columns]
        return out

    def as_dict(self) -> dict[str, Any]:
        """For JSON: the values and their medians."""
        medians = {
            method: {metric: median(series) for metric, series in metrics.items()}
            for method, metrics in self.values.items()
        }
        return {"values": self.values, "medians": medians, "orders": self.orders}


# -- the loops -------------------------------------------------------------------------------------


def measure_save(
    method: Method,
    state: State,
    directory: Path,
    while_draining: Callable[[], object] | None = None,
) -> dict[str, float]:
    """One save, measured as its caller sees it: ``pause`` (blocked), and for an asynchronous
    method its ``details``, its ``drain`` (from the pause's end to the commit, running
    ``while_draining`` meanwhile) and its phases."""
    call_s, pending = timed(lambda: method.save(state, directory))
    if pending is None:
        if while_draining is not None:
            while_draining()
        return {"pause": call_s}
    drain_start = time.perf_counter()
    if while_draining is not None:
        while_draining()
    phases = pending.wait()
    drain_s = time.perf_counter() - drain_start
    return {"pause": pending.pause, **pending.details, "drain": drain_s, **phases}


@dataclass(kw_only=True)
class SaveLoadRound:
    """One repetition of a save-and-load comparison: every method that saves saves ``state``
    into its directory, then every method that loads loads its directory into ``destination``
    (cleared first, then ``before_load``: the page cache evicted), then ``verify``."""

    state: State
    destination: State
    clear: Callable[[State], None]
    before_load: Callable[[Path], float | None]
    """Evicts the directory about to be read; returns the fraction of it still resident."""
    verify: Callable[[Method], None]
    timer: Timer = wall_time
    saves: bool = True
    """False: load the snapshots already in the directories (a reshard, another world)."""
    loads: int = 1
    """Loads of each method's snapshot per repetition, the order of the methods rotating from
    one to the next: a cold load's time swings with the disk's other tenants, and one save
    costs more than several loads."""

    def run(
        self, methods: Sequence[Method], directories: Mapping[str, Path], results: Measurements
    ) -> None:
        results.orders.append([method.name for method in methods])
        for method in methods:
            if self.saves and method.can_save:
                save = functools.partial(method.save, self.state, directories[method.name])
                results.add(method.name, "save", self.timer(save))
        for turn in range(self.loads):
            for method in rotated(methods, turn):
                if method.can_load:
                    self.load(method, directories[method.name], results)

    def load(self, method: Method, directory: Path, results: Measurements) -> None:
        method.prepare_load(self.destination, directory)
        self.clear(self.destination)
        results.add(method.name, "resident", self.before_load(directory))
        seconds = self.timer(lambda: method.load(self.destination, directory))
        results.add(method.name, "load", seconds)
        self.verify(method)
