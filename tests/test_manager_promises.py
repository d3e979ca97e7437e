"""Promises the manager keeps or refuses out loud: a root it cannot write, retention that keeps
disk within n + 1 snapshots' bytes while saves run back to back, memory replicas that cannot be
placed on distinct nodes."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

import trainsnap as ts
from trainsnap.storage.posix import PosixStorage


class _ReadOnly(PosixStorage):
    """A root on a read-only mount: every write fails with EROFS, as the kernel's would."""

    def _refuse(self, key: str) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(self._path(key)))

    def put(self, key, data):  # type: ignore[no-untyped-def]
        self._refuse(key)

    def put_if_absent(self, key, data):  # type: ignore[no-untyped-def]
        self._refuse(key)

    def delete(self, key):  # type: ignore[no-untyped-def]
        self._refuse(key)


def test_a_read_only_root_is_refused_naming_the_root_and_the_fix(tmp_path: Path) -> None:
    """Why: ``CheckpointManager`` on a read-only root raised a bare ``OSError`` (errno 30)."""
    ts.save({"w": torch.ones(2)}, tmp_path, step=1)
    with pytest.raises(ts.TrainsnapError) as caught:
        ts.CheckpointManager(_ReadOnly(tmp_path))
    message = str(caught.value)
    assert str(tmp_path) in message and "EROFS" in message
    assert "read-write" in message and "ts.load" in message
    assert [s.step for s in ts.list_snapshots(tmp_path)] == [1]  # still readable


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_keep_last_holds_disk_within_n_plus_one_snapshots_with_a_save_every_step(
    tmp_path: Path,
) -> None:
    """Why: with ``KeepLast(2)`` and an asynchronous save every step (always one in flight),
    ``objects/`` grew 20 -> 40 -> 56 -> 60 MiB over 20 saves and was reclaimed only at
    ``close()``: the collector stopped whenever a save was in flight. A 4 MiB model, 20 saves."""
    weights = torch.zeros(1 << 20)  # 4 MiB of float32
    mgr = ts.CheckpointManager(
        tmp_path, interval=ts.Every(steps=1), retention=[ts.KeepLast(2)], async_save=True
    )
    sizes = []
    for step in range(20):
        weights.fill_(float(step))  # every snapshot's bytes are new
        assert mgr.step(step, {"w": weights})
        sizes.append(_bytes_under(tmp_path / "objects"))
    mgr.close()
    snapshot = weights.numel() * weights.element_size()
    assert max(sizes) <= 3 * snapshot, [s / snapshot for s in sizes]
    assert _bytes_under(tmp_path / "objects") <= 2 * snapshot
    assert [s.step for s in ts.list_snapshots(tmp_path)] == [18, 19]


def test_memory_replicas_that_cannot_go_to_distinct_nodes_are_refused(tmp_path: Path) -> None:
    """Why: ``MemoryTier(replicas=1)`` in one process (one node) committed with no partner copy,
    although a memory snapshot is documented to commit only once every object has 1 + replicas
    copies on distinct nodes."""
    state = {"w": torch.ones(4)}
    tier = ts.MemoryTier(root=str(tmp_path / "shm"), replicas=1)
    mgr = ts.CheckpointManager(tmp_path / "durable", memory=tier, async_save=False)
    with pytest.raises(ts.InvalidArgumentError) as caught:
        mgr.step(1, state)
    message = str(caught.value)
    for fix in ("at least 2 nodes", "replicas=0", "allow_fewer_copies=True", "GROUP_RANK"):
        assert fix in message, message
    mgr.close()
    assert not list((tmp_path / "shm").rglob("COMMITTED"))  # nothing committed
    fewer = ts.MemoryTier(root=str(tmp_path / "shm2"), replicas=1, allow_fewer_copies=True)
    with ts.CheckpointManager(tmp_path / "durable2", memory=fewer, async_save=False) as opted:
        assert opted.step(1, state)


def test_every_tier_reads_the_node_from_the_same_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why: ``MemoryTier`` read ``GROUP_RANK`` before ``NODE_RANK``, ``LocalTier`` the other way
    round: with both set, the two tiers of one process took different nodes."""
    from trainsnap.manager import memory_nodes, placement, tiers

    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "0")
    assert memory_nodes.this_node(None) == placement.node_from_environment("x") == 1
    local = tiers.open_local(
        [ts.open_storage("memory://a"), ts.open_storage("memory://b")], None, False, None
    )
    assert local.node == 1  # type: ignore[attr-defined]
