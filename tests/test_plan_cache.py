"""Cached save plans: a rank whose layout did not change sends a digest, the coordinator reuses
its plan; any layout change on any rank (a shape, a key, a restarted rank) replans exactly, and
every kind of layout change (dtype, shape, placement, key, value key, replica) changes the
digest."""

from __future__ import annotations

import pytest
import torch

import trainsnap as ts
from trainsnap.protocol.control_plane import default_comm
from trainsnap.testing import assert_all_ok, run_ranks


def _state(
    rank: int, step: int, *, wide: bool = False, extra: bool = False, world: int = 2
) -> dict:
    cols = 3 if wide else 2
    state = {
        "w": ts.Sharded(
            torch.full((2, 4), float(step + rank)),
            global_shape=(2 * world, 4),
            offsets=(2 * rank, 0),
        ),
        # Plain, the same bytes on every rank: a replica (its digest is part of the layout).
        "b": torch.ones(cols),
        "step": step,
    }
    if extra and rank == 1:
        state["only_here"] = torch.ones(1)
    return state


def _saves(rank: int, world: int, root: str) -> list[tuple[str, int, int, int]]:
    """Six saves; returns, after each, (what changed, full plans, reused plans, digests)."""
    out = []
    changes = ["first", "same", "same", "shape", "key", "restart", "same"]
    for step, change in enumerate(changes, start=1):
        if change == "restart" and rank == 1:
            default_comm().plans.forget_sent()  # what a restarted process remembers
        wide, extra = step >= 4, step >= 5  # each change stays
        state = _state(rank, step, wide=wide, extra=extra)
        ts.save(state, root, step=step, timeout=60)
        dst = _state(rank, 0, wide=wide, extra=extra)
        ts.load(dst, root, timeout=60)  # every snapshot is exactly what was saved
        assert torch.equal(dst["w"].local, state["w"].local) and dst["step"] == step
        assert torch.equal(dst["b"], state["b"])
        counts = default_comm().plans.counts
        out.append((change, counts["full"], counts["reused"], counts["digests_received"]))
    return out


def test_plans_are_reused_while_layouts_stay_and_replanned_on_any_change(tmp_path):
    coordinator, _ = assert_all_ok(run_ranks(_saves, 2, args=(str(tmp_path),), timeout=120))
    assert coordinator == [
        ("first", 1, 0, 0),
        ("same", 1, 1, 2),  # both ranks sent a digest; the plan was reused
        ("same", 1, 2, 4),
        ("shape", 2, 2, 4),  # a shape changed on both ranks: both sent everything
        ("key", 3, 2, 5),  # rank 1 added a key and sent everything, rank 0 a digest
        ("restart", 3, 3, 6),  # rank 1 forgot and sent everything: the same layout, reused
        ("same", 3, 4, 8),
    ]
    assert ts.verify(tmp_path).ok


def _forgetful_coordinator(rank: int, world: int, root: str) -> list[str]:
    ts.save(_state(rank, 1), root, step=1, timeout=60)
    if rank == 0:
        default_comm().plans.forget_plans()  # the coordinator lost its plan, the ranks did not
    outcomes = []
    for step in (2, 3):
        try:
            ts.save(_state(rank, step), root, step=step, timeout=60)
            outcomes.append("saved")
        except ts.InvalidArgumentError as e:
            outcomes.append(str(e.problems))
    return outcomes


@pytest.mark.xfail(
    strict=True,
    reason="known defect: ts.save opens a new control plane per call, so every call's session "
    "has the same name; after a refused save the next one reads a record the refused session "
    "left and fails too (it used to hang); session names must not recur across calls",
)
def test_a_digest_the_coordinator_does_not_hold_refuses_one_save_then_replans(tmp_path):
    for outcomes in assert_all_ok(run_ranks(_forgetful_coordinator, 2, args=(str(tmp_path),))):
        assert "does not hold" in outcomes[0] and outcomes[1] == "saved"
    assert [s.step for s in ts.list_snapshots(tmp_path)] == [1, 3]


def _killed_during_cached_save(rank: int, world: int, root: str) -> tuple[str, int]:
    import os

    ts.save(_state(rank, 1, world=world), root, step=1, timeout=60)
    os.environ["TRAINSNAP_FAULTS"] = os.environ.get("LATER_FAULTS", "")
    try:
        ts.save(_state(rank, 2, world=world), root, step=2, timeout=30)
    except ts.CommitFailedError as e:
        return f"failed: {e}", default_comm().plans.counts["reused"]
    return "committed", default_comm().plans.counts["reused"]


def test_a_rank_killed_during_a_cached_save_fails_the_commit_and_is_named(tmp_path):
    rank_env = {1: {"LATER_FAULTS": "before_write=crash", "TRAINSNAP_HEARTBEAT_SECONDS": "5"}}
    results = run_ranks(
        _killed_during_cached_save,
        3,
        args=(str(tmp_path),),
        timeout=120,
        env={"TRAINSNAP_HEARTBEAT_SECONDS": "5"},
        rank_env=rank_env,
    )
    assert results[1].killed
    text, reused = results[0].value
    assert reused == 1  # the save that lost rank 1 was planned from the cache
    assert text.startswith("failed") and "rank 1:" in text, text
    assert results[2].value[0].startswith("failed")
    assert [s.step for s in ts.list_snapshots(tmp_path)] == [1]


def _layout(state: dict) -> bytes:
    """The layout digest a rank sends for ``state`` (what a cached save compares)."""
    from trainsnap.format.checksums import Hasher
    from trainsnap.protocol.planner import layout_digest
    from trainsnap.protocol.rank_save import SaveRequest, describe
    from trainsnap.tunables import get

    opts = SaveRequest(step=1)
    local = describe(
        state, opts, Hasher(opts.options.checksum, get().block_size), replica_digests=True
    )
    return layout_digest(local.meta(0, 1))


def _one(
    local: torch.Tensor | None = None,
    global_shape: tuple[int, int] = (4, 4),
    offsets: tuple[int, int] = (0, 0),
    **extra: object,
) -> dict:
    state: dict = {
        "w": ts.Sharded(
            torch.zeros(2, 4) if local is None else local,
            global_shape=global_shape,
            offsets=offsets,
        ),
        "b": torch.ones(4),
        "lr": 0.1,
    }
    state.update(extra)
    return state


def test_every_kind_of_layout_change_changes_the_digest_and_new_values_do_not() -> None:
    base = _layout(_one())
    # values changed, nothing else (a value's contents, even its type, are assigned every save)
    same_layout = _one(local=torch.full((2, 4), 7.0), lr="0.5")
    assert _layout(same_layout) == base
    changed = {
        "dtype": _one(local=torch.zeros(2, 4, dtype=torch.float64)),
        "shape": _one(local=torch.zeros(2, 8), global_shape=(4, 8)),
        "global shape": _one(global_shape=(6, 4)),
        "placement": _one(offsets=(2, 0)),
        "added key": _one(c=torch.ones(1)),
        "added value key": _one(momentum=0.9),
        "replica's bytes": {**_one(), "b": torch.full((4,), 2.0)},  # no longer the same replica
    }
    renamed = _one()
    renamed["w2"] = renamed.pop("w")
    changed["renamed key"] = renamed
    digests = {what: _layout(state) for what, state in changed.items()}
    assert [what for what, digest in digests.items() if digest == base] == []
    assert len(set(digests.values())) == len(digests)
