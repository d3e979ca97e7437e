"""Every cross-rank step fails alike on every rank, at once, naming the rank that failed and why
(``protocol/collective.py``, the control plane's ``abandon`` and liveness).

Real processes (``trainsnap.testing``), three ranks, the default heartbeat (60 s): a rank whose
failure reached the others only through its heartbeat would keep them waiting a minute, so the
bounds below (5 s for a rank that raises, 10 s for one killed) tell the two apart. One run of
processes goes through every step of a save and of a load in turn, a fault on one rank in each.
"""

from __future__ import annotations

import errno
import importlib
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import trainsnap as ts
from trainsnap import faults
from trainsnap.errors import LoadFailedError, RankFailure, TrainsnapError
from trainsnap.protocol import collective
from trainsnap.protocol.control_plane import LocalComm
from trainsnap.testing import run_ranks

WORLD = 3
RAISED_WITHIN = 5.0
KILLED_WITHIN = 10.0

SAVE_STEPS = {  # step -> (module, function that raises, rank it raises on)
    "describe (before the first exchange)": ("trainsnap.protocol.save_protocol", "_capture", 1),
    "plan (the coordinator's reduce)": ("trainsnap.protocol.save_protocol", "_planned", 0),
    "write (reported)": ("trainsnap.protocol.save_protocol", "write_assigned", 2),
    "report (a step's local)": ("trainsnap.protocol.write_reports", "outgoing", 1),
    "commit (the coordinator)": ("trainsnap.protocol.commit", "write_commit", 0),
}
LOAD_STEPS = {
    "latest (the coordinator's decision)": ("trainsnap.protocol.commit", "list_committed", 0),
    "wants (a step's local)": ("trainsnap.protocol.manifest_share", "classes_of", 1),
    "open (the coordinator's reduce)": ("trainsnap.protocol.commit", "open_snapshot", 0),
    "read (a step's local)": ("trainsnap.protocol.load_protocol", "_read", 2),
}


def _state(rank: int, value: float = 0.0) -> dict[str, Any]:
    local = torch.full((2, 4), float(rank) + value)
    return {"w": ts.Sharded(local, global_shape=(2 * WORLD, 4), offsets=(2 * rank, 0)), "n": 1}


class _Injected:
    """Replaces ``module.name`` with a function that raises an ``OSError`` (EIO), noting when."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = importlib.import_module(module), name
        self.original = getattr(self.module, name)
        self.at: float | None = None

    def __enter__(self) -> _Injected:
        def fail(*args: Any, **kwargs: Any) -> Any:
            self.at = time.monotonic()
            raise OSError(errno.EIO, "injected I/O error")

        setattr(self.module, self.name, fail)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self.module, self.name, self.original)


def _each_step(rank: int, world: int, root: str, only: str = "") -> dict[str, tuple[Any, ...]]:
    """Every save step, then every load step, with one rank failing in it. Per step: (whether
    this rank failed it, the kind of error raised, whether a TrainsnapError, its text, when it
    was raised, when this rank's fault was injected)."""
    import torch.distributed as dist

    out: dict[str, tuple[Any, ...]] = {}
    ts.save(_state(rank), f"{root}/loaded", step=1)
    for steps, op in ((SAVE_STEPS, "save"), (LOAD_STEPS, "load")):
        for i, (step, (module, name, failing)) in enumerate(steps.items()):
            if only and not step.startswith(only):
                continue
            dist.barrier()
            injected: _Injected | None = None
            try:
                if rank == failing:
                    injected = _Injected(module, name).__enter__()
                if op == "save":
                    ts.save(_state(rank), f"{root}/save-{i}", step=2)
                else:
                    ts.load(_state(rank), f"{root}/loaded")
                error: BaseException | None = None
            except Exception as e:
                error = e
            finally:
                raised = time.monotonic()
                if injected is not None:
                    injected.__exit__()
            out[step] = (
                rank == failing,
                type(error).__name__ if error else None,
                isinstance(error, TrainsnapError),
                str(error),
                raised,
                injected.at if injected else None,
            )
    return out


@pytest.mark.slow
def test_a_rank_that_raises_in_any_step_of_a_save_or_a_load_is_named_by_every_other_rank_at_once(
    tmp_path: Path,
) -> None:
    results = run_ranks(_each_step, WORLD, args=(str(tmp_path),), timeout=300)
    for result in results:
        assert result.ok, result.error
    for step, (_, _, failing) in {**SAVE_STEPS, **LOAD_STEPS}.items():
        injected = results[failing].value[step][5]
        assert injected is not None, (step, results[failing].value[step])
        for rank, result in enumerate(results):
            failed, kind, typed, text, raised, _ = result.value[step]
            assert kind is not None, (step, rank, "did not fail")
            if failed:
                continue  # the failing rank raises its own error, as it was raised
            assert typed, (step, rank, kind, text)
            assert f"rank {failing}:" in text and "OSError" in text, (step, rank, text)
            assert "injected I/O error" in text, (step, rank, text)
            assert raised - injected < RAISED_WITHIN, (step, rank, raised - injected, text)


def _killed_mid_step(rank: int, world: int, root: str, op: str) -> tuple[str, float]:
    ts.save(_state(rank), root, step=1)
    if rank == 1:  # SIGKILLed as it writes (a save) or reads (a load): no handler runs
        faults.install("before_write=crash" if op == "save" else "load_read=crash")
    started = time.monotonic()
    try:
        if op == "save":
            ts.save(_state(rank, 10.0), root, step=2)  # new bytes: written, not reused
        else:
            ts.load(_state(rank), root)
    except TrainsnapError as e:
        return str(e), time.monotonic() - started
    return "no error", time.monotonic() - started


@pytest.mark.slow
@pytest.mark.parametrize("op", ["save", "load"])
def test_a_rank_killed_mid_step_is_named_by_the_survivors_within_seconds(
    tmp_path: Path, op: str
) -> None:
    results = run_ranks(_killed_mid_step, WORLD, args=(str(tmp_path), op), timeout=200)
    assert results[1].killed, results[1]
    for rank in (0, 2):
        assert results[rank].ok, results[rank].error
        text, seconds = results[rank].value
        assert "rank 1:" in text and "process ended" in text, (rank, text)
        assert seconds < KILLED_WITHIN, (rank, seconds, text)


# -- one process ------------------------------------------------------------------------------


def _refuse(ranks: Any) -> TrainsnapError:
    return LoadFailedError("refused", rank_errors=ranks)


def test_one_process_raises_its_own_error_as_it_is() -> None:
    comm = LocalComm()
    session = comm.session("load")

    def local() -> int:
        raise OSError(errno.EIO, "injected")

    with pytest.raises(OSError, match="injected"):
        collective.all_reduce(comm, session, "step", local, sum, _refuse)
    assert session.failed


def test_vote_and_decide_in_one_process() -> None:
    comm = LocalComm()
    session = comm.session("vote")
    assert collective.vote(comm, session, "all", True, _refuse)
    assert not collective.vote(comm, session, "none", False, _refuse)
    assert collective.vote(comm, session, "any", True, _refuse, rule=any)
    assert collective.decide(comm, session, "which", lambda: "s1", _refuse) == "s1"


def test_a_failure_record_names_its_rank_kind_and_step() -> None:
    try:
        raise OSError(errno.EIO, "disk gone")
    except OSError as e:
        record = RankFailure.of(2, e, "save/write")
    assert (record.rank, record.kind, record.where) == (2, "OSError", "save/write")
    assert str(record).startswith("rank 2: OSError: [Errno 5] disk gone (at test_collective.py:")
    assert str(record).endswith(" (in save/write)")
    error = LoadFailedError("failed", rank_errors={2: record, 0: "gone"})
    assert error.failures[2] is record and error.rank_errors[0] == "gone"
    assert error.rank_errors[2].startswith("OSError: [Errno 5] disk gone")
    assert "rank 0: gone" in str(error) and "rank 2: OSError" in str(error)
