"""Reports: plain-text tables, targets and their verdicts, and :func:`compare`, the one report of
a comparison every benchmark prints (medians of the repetitions, ratios against the
alternatives, each target printed as met or MISSED, the individual values, the orders).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._framework.method import Measurements


def gbps(nbytes: float, seconds: float) -> float:
    """Decimal GB per second."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan


def fmt(value: object, digits: int = 3) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], digits: int = 3) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    cells = [[fmt(cell, digits) for cell in row] for row in rows]
    widths = [len(header) for header in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(row: Sequence[str]) -> str:
        parts = [c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in cells)])


Column = tuple[str, Callable[[Any], object]]
"""A table's column: its header, and the function of a record that gives its cell."""


def records_table(records: Sequence[Any], columns: Sequence[Column], digits: int = 3) -> str:
    """A :func:`format_table` of ``records``, one row each, the cells given by ``columns``."""
    headers = [header for header, _ in columns]
    rows = [[cell(record) for _, cell in columns] for record in records]
    return format_table(headers, rows, digits)


def facts(label: str, values: Mapping[str, object]) -> str:
    """``label: key=value, key=value`` of a dict, for one-line reports (the machine, the state)."""
    return f"{label}: " + ", ".join(f"{key}={value}" for key, value in values.items())


def seconds_list(values: Sequence[float]) -> str:
    return " ".join(f"{value:.3f}" for value in values)


# -- targets ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """A bound a figure must respect: ``value <relation> bound``."""

    relation: str
    bound: float

    def __post_init__(self) -> None:
        if self.relation not in ("<", "<=", ">="):
            raise ValueError(f"relation must be <, <= or >=, got {self.relation!r}")

    def met(self, value: float) -> bool:
        if self.relation == "<":
            return value < self.bound
        return value <= self.bound if self.relation == "<=" else value >= self.bound

    def __str__(self) -> str:
        return f"{self.relation} {self.bound:g}"


@dataclass(frozen=True, slots=True)
class Check:
    """One figure of a report, and the target it must meet (None: reported only)."""

    label: str
    value: float
    target: Target | None = None

    @property
    def result(self) -> str:
        if self.target is None:
            return "-"
        return "met" if self.target.met(self.value) else "MISSED"

    def row(self) -> list[object]:
        return [
            self.label,
            self.value,
            "-" if self.target is None else str(self.target),
            self.result,
        ]


@dataclass(frozen=True, slots=True)
class Ratio:
    """The ratio of two medians, each (method, metric), e.g. trainsnap's load over DCP's."""

    label: str
    numerator: tuple[str, str]
    denominator: tuple[str, str]
    target: Target | None = None

    def check(self, results: Measurements) -> Check:
        value = results.median(*self.numerator) / results.median(*self.denominator)
        return Check(self.label, value, self.target)


def verdicts(checks: Sequence[Check], *, first: str = "check", digits: int = 2) -> str:
    """The table of ``checks``: value, target, and met / MISSED (or ``-`` without a target)."""
    rows = [check.row() for check in checks]
    return format_table([first, "value", "target", "result"], rows, digits=digits)


# -- the comparison --------------------------------------------------------------------------------


@dataclass
class Comparison:
    """What :func:`compare` made: the report's lines and its checks (for a summary)."""

    lines: list[str]
    checks: list[Check] = field(default_factory=list)


def _medians_table(
    results: Measurements,
    nbytes: int,
    metrics: Sequence[str],
    rates: Sequence[str],
    columns: Mapping[str, Mapping[str, object]],
) -> str:
    headers = ["method"]
    for metric in metrics:
        headers.append(f"{metric} s (median)")
        if metric in rates:
            headers.append(f"{metric} GB/s")
    headers += list(columns)
    rows = []
    for method in results.methods:
        row: list[object] = [method]
        for metric in metrics:
            seconds = results.median(method, metric)
            row += [seconds, gbps(nbytes, seconds)] if metric in rates else [seconds]
        row += [values.get(method, "-") for values in columns.values()]
        rows.append(row)
    return format_table(headers, rows)


def _values_table(
    results: Measurements, metrics: Sequence[str], warmup: Measurements | None
) -> str:
    headers = ["method", "times"] + ([] if warmup is None else ["warm-up (not counted)"])
    rows = []
    for method in results.methods:
        for metric in metrics:
            if results.has(method, metric):
                row = [f"{method} {metric}", seconds_list(results.series(method, metric))]
                if warmup is not None:
                    row.append(seconds_list(warmup.series(method, metric)))
                rows.append(row)
    return format_table(headers, rows)


def orders_line(orders: Sequence[Sequence[str]], separator: str = " ") -> str:
    return "orders: " + "; ".join(separator.join(order) for order in orders)


def compare(
    results: Measurements,
    *,
    nbytes: int,
    metrics: Sequence[str],
    ratios: Sequence[Ratio] = (),
    ratio_title: str = "ratios (medians):",
    rates: Sequence[str] | None = None,
    columns: Mapping[str, Mapping[str, object]] | None = None,
    warmup: Measurements | None = None,
) -> Comparison:
    """The report of a comparison of methods on ``nbytes`` bytes.

    1. The medians of ``metrics`` (seconds) per method, and GB/s of those in ``rates`` (all by
       default), then ``columns`` (header -> method -> value).
    2. ``ratios`` of medians, each with its target and its verdict (met / MISSED).
    3. Every repetition's values (and the warm-up repetitions', not counted), and the orders.
    """
    rates = metrics if rates is None else rates
    checks = [ratio.check(results) for ratio in ratios]
    lines = [_medians_table(results, nbytes, metrics, rates, columns or {})]
    if checks:
        lines += ["", ratio_title, verdicts(checks, first="ratio")]
    lines += ["", "individual times (seconds, in repetition order):"]
    lines += [_values_table(results, metrics, warmup), orders_line(results.orders)]
    return Comparison(lines, checks)


def emit(out: dict[str, Any], text: str, json_path: str | None) -> None:
    """Print a benchmark's report and, when asked, write its results as JSON."""
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2, default=_jsonable) + "\n")
        print(f"wrote {json_path}")


def _jsonable(value: object) -> object:
    if isinstance(value, Measurements):
        return value.as_dict()
    if hasattr(value, "__dataclass_fields__"):
        return {name: getattr(value, name) for name in value.__dataclass_fields__}
    return str(value)
