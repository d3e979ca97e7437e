"""The power-cut file system itself: the strict POSIX durability rule, cuts after the n-th
operation and on command, error injection, torn cuts, and a fresh mount after a cut."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from trainsnap.testing.powercut import PowerCutFS, cut_states, unavailable
from trainsnap.testing.powercut_fs import Model

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes, *, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _tree(where: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(where)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(where.rglob("*"))
    }


def test_data_needs_a_file_fsync_and_a_name_its_directory_fsync(tmp_path: Path) -> None:
    with PowerCutFS(tmp_path / "fs") as fs:
        m = fs.mount
        (m / "d").mkdir()
        _fsync(m)  # "d" is durable, empty
        _write(m / "d" / "synced", b"data", sync=True)  # data durable, name not yet
        _write(m / "d" / "unsynced", b"lost", sync=False)
        before_dir_sync = fs.ops()
        _fsync(m / "d")
        after = fs.ops()
        states = {n: _tree(w) for n, w in fs.cuts(tmp_path / "cut", [before_dir_sync, after])}
    assert states[before_dir_sync] == {"d": None}
    # the name of an unsynced file survives, its data does not
    assert states[after] == {"d": None, "d/synced": b"data", "d/unsynced": b""}


def test_a_rename_is_durable_only_once_its_directory_is_synced(tmp_path: Path) -> None:
    with PowerCutFS(tmp_path / "fs") as fs:
        m = fs.mount
        _write(m / "a", b"old", sync=True)
        _fsync(m)
        _write(m / ".tmp", b"new", sync=True)
        os.replace(m / ".tmp", m / "a")
        renamed = fs.ops()
        _fsync(m)
        states = {n: _tree(w) for n, w in fs.cuts(tmp_path / "cut", [renamed, fs.ops()])}
    assert states[renamed] == {"a": b"old"}
    assert states[renamed + 1] == {"a": b"new"}


def test_a_removal_is_undone_by_a_cut_before_its_directory_sync(tmp_path: Path) -> None:
    with PowerCutFS(tmp_path / "fs") as fs:
        m = fs.mount
        (m / "d").mkdir()
        _write(m / "d" / "f", b"x", sync=True)
        _fsync(m / "d")
        _fsync(m)
        os.unlink(m / "d" / "f")
        os.rmdir(m / "d")
        removed = fs.ops()
        _fsync(m)  # the directory's removal is durable; its own entries never were synced
        states = {n: _tree(w) for n, w in fs.cuts(tmp_path / "cut", [removed, fs.ops()])}
    assert states[removed] == {"d": None, "d/f": b"x"}
    assert states[removed + 1] == {}


def test_a_cut_after_n_operations_fails_every_later_one_and_a_fresh_mount_shows_the_durable_state(
    tmp_path: Path,
) -> None:
    with PowerCutFS(tmp_path / "fs") as fs:
        m = fs.mount
        _write(m / "kept", b"1", sync=True)
        _fsync(m)
        synced = fs.ops()
        fs.cut_after(synced + 2)  # the create and the write of the next file, no sync
        _write(m / "lost", b"2", sync=False)
        with pytest.raises(OSError) as caught:
            _write(m / "after", b"3", sync=True)
        assert caught.value.errno == errno.EIO
        kept = fs.power_cycle()
        assert kept == synced + 2
        assert _tree(m) == {"kept": b"1"}
        _write(m / "again", b"4", sync=True)  # the new mount works and starts a new trace
        assert fs.ops() == 3  # its create, write and fsync


def test_an_injected_directory_fsync_error_reaches_the_caller(tmp_path: Path) -> None:
    with PowerCutFS(tmp_path / "fs") as fs:
        (fs.mount / "d").mkdir()
        fs.fail("fsyncdir", "/d", times=1)
        with pytest.raises(OSError) as caught:
            _fsync(fs.mount / "d")
        assert caught.value.errno == errno.EIO
        _fsync(fs.mount / "d")  # once only
        assert fs.hits() == [1]


def test_a_torn_cut_keeps_a_prefix_of_the_unsynced_changes(tmp_path: Path) -> None:
    with PowerCutFS(tmp_path / "fs") as fs:
        for i in range(6):
            _write(fs.mount / f"f{i}", b"%d" % i, sync=False)
        initial, events = fs.trace()
    seen = set()
    for seed in range(12):
        ((_, where),) = cut_states(initial, events, tmp_path / "cut", [len(events)], torn=seed)
        tree = _tree(where)
        names = sorted(tree)
        assert names == [f"f{i}" for i in range(len(names))], "a prefix, in order"
        seen.add(len(names))
    assert len(seen) > 2, "torn cuts keep prefixes of several lengths"


def test_the_model_reads_back_what_it_scanned(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"xyz")
    os.symlink("b/f", tmp_path / "a" / "link")
    model = Model.scan(tmp_path)
    ((_, where),) = cut_states(model, [], tmp_path.parent / "copy", [0])
    assert _tree(where) == {"a": None, "a/b": None, "a/b/f": b"xyz", "a/link": b"xyz"}
    assert os.readlink(where / "a" / "link") == "b/f"
