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
