"""The chaos suite's bookkeeping and its contract checks.

Each trial injects one fault into a real save or load and then checks the correctness contract
on the root, with every fault switched off:

* every listed snapshot is committed, and each either loads bitwise equal to what was saved at
  its step or is refused with a TrainsnapError (damage is detected, never passed on);
* the newest snapshot that loads holds exactly what was saved at its step;
* a collection (no writer active) leaves exactly the objects the committed snapshots reference,
  and every snapshot that loaded before still loads after.

``TRAINSNAP_CHAOS_TRIALS`` scales the number of trials (the bounded CI form uses the default).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import trainsnap as ts
from trainsnap.manager import collection
from trainsnap.protocol import commit
from trainsnap.storage import open_storage


def trials(default: int) -> int:
    return int(os.environ.get("TRAINSNAP_CHAOS_TRIALS", default))


@dataclass
class Row:
    trials: int = 0
    injected: int = 0
    detected: int = 0
    violations: list[str] = field(default_factory=list)


TABLE: dict[str, Row] = {}


def record(fault: str, detected: bool, violations: list[str], injected: int = 1) -> None:
    """One trial: ``injected`` faults went in; ``detected`` when some part of the system
    noticed (an error raised, a retry, damage refused) rather than none at all."""
    row = TABLE.setdefault(fault, Row())
    row.trials += 1
    row.injected += injected
    row.detected += int(detected)
    row.violations += violations


def render() -> str:
    if not TABLE:
        return ""
    lines = [f"{'fault':<46} {'trials':>6} {'faults':>6} {'detected':>8}  outcome"]
    total = injected = bad = 0
    for fault, row in sorted(TABLE.items()):
        outcome = "contract held" if not row.violations else f"{len(row.violations)} VIOLATION(S)"
        lines.append(f"{fault:<46} {row.trials:>6} {row.injected:>6} {row.detected:>8}  {outcome}")
        total += row.trials
        injected += row.injected
        bad += len(row.violations)
    lines.append(f"{'total':<46} {total:>6} {injected:>6} {'':>8}  {bad} violation(s)")
    for fault, row in sorted(TABLE.items()):
        lines += [f"  {fault}: {v}" for v in row.violations[:5]]
    return "\n".join(lines)


def expected(step: int, shape: tuple[int, ...] = (96, 1024)) -> dict[str, object]:
    """The state saved at ``step``: a pure function of the step."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(shape, generator=g),
        "small": [torch.randn(7, generator=g) for _ in range(5)],
        "step": step,
    }


def blank(shape: tuple[int, ...] = (96, 1024)) -> dict[str, object]:
    return {"w": torch.zeros(shape), "small": [torch.zeros(7) for _ in range(5)], "step": None}


def same(a: dict[str, object], b: dict[str, object]) -> bool:
    ta, tb = a["w"], b["w"]
    assert isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor)
    small_a, small_b = a["small"], b["small"]
    assert isinstance(small_a, list) and isinstance(small_b, list)
    return (
        torch.equal(ta, tb)
        and all(torch.equal(x, y) for x, y in zip(small_a, small_b, strict=True))
        and a["step"] == b["step"]
    )


def check_contract(
    root: Path,
    make: Callable[[int], dict[str, object]] = expected,
    fresh: Callable[[], dict] = blank,
) -> tuple[list[str], bool]:
    """(violations, whether damage was detected) for a root after a trial."""
    storage = open_storage(root)
    violations: list[str] = []
    damaged = False
    loadable: list[str] = []
    ids = set()
    for info in ts.list_snapshots(storage):
        ids.add(info.id)
        try:
            commit.committed_marker(storage, info.id)
        except ts.TrainsnapError as e:
            violations.append(f"listed snapshot {info.id} is not committed: {e}")
            continue
        dst = fresh()
        try:
            ts.load(dst, storage, snapshot=info.id)
        except ts.TrainsnapError:
            damaged = True
            continue
        if not same(dst, make(info.step)):
            violations.append(f"snapshot {info.id} (step {info.step}) loaded different values")
        else:
            loadable.append(info.id)
    uncommitted = commit.snapshot_ids(storage) - ids
    for sid in uncommitted:
        try:
            ts.load(fresh(), storage, snapshot=sid)
            violations.append(f"uncommitted snapshot {sid} was readable")
        except ts.TrainsnapError:
            pass
    # Collection with no writer active, then everything that loaded must still load.
    try:
        collection.collect(storage, grace=None)
    except ts.TrainsnapError:
        return violations, True  # a committed manifest is damaged: collection refuses (detected)
    on_disk = {k.rsplit("/", 1)[-1] for k in storage.list("objects/")}
    referenced: set[str] = set()
    for c in commit.list_committed(storage):
        referenced |= set(commit.open_snapshot(storage, c.snapshot_id).object_names)
    if on_disk != referenced:
        violations.append(
            f"after collection {len(on_disk - referenced)} garbage object(s) remain and "
            f"{len(referenced - on_disk)} referenced object(s) are missing"
        )
    for sid in loadable:
        dst = fresh()
        try:
            info = ts.load(dst, storage, snapshot=sid)
        except ts.TrainsnapError as e:
            violations.append(f"collection broke snapshot {sid}: {e}")
            continue
        if not same(dst, make(info.step)):
            violations.append(f"after collection snapshot {sid} loads different values")
    return violations, damaged or bool(uncommitted)
