"""Column pieces whose bytes are not in the page cache, read through their bounce windows straight
from the device (``O_DIRECT``), each block verified before it is copied into its rows."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
from pathlib import Path

import pytest
import torch

import trainsnap as ts
from trainsnap import tunables
from trainsnap.storage import posix
from trainsnap.storage.base import ShortReadError
from trainsnap.storage.posix import PosixStorage
from trainsnap.testing import assert_all_ok, run_ranks

ROWS, COLUMNS = 250, 1024
# Blocks of 64 KiB (direct reads need page-sized blocks); a quarter is 250 KiB of 1 KiB rows, so
# its object ends mid-page and every piece goes through a window.
ENV = {"TRAINSNAP_BLOCK_SIZE": str(64 << 10), "TRAINSNAP_CHUNK_SIZE": str(256 << 10)}


def _full(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(seed))


def _save_quarters(rank: int, world: int, root: str) -> None:
    width = COLUMNS // world
    state = {}
    for name, seed in (("a", 1), ("b", 2)):
        local = _full(seed)[:, rank * width : (rank + 1) * width].clone()
        state[name] = ts.Sharded(local, global_shape=(ROWS, COLUMNS), offsets=(0, rank * width))
    ts.save(state, root, step=1, timeout=120)


def _evict(root: Path) -> None:
    for path in (p for p in root.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _objects(root: Path) -> list[Path]:
    return [p for p in (root / "objects").rglob("*") if p.is_file()]


@pytest.fixture(scope="module")
def quarters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two tensors saved as four column quarters by four ranks."""
    root = tmp_path_factory.mktemp("quarters")
    assert_all_ok(run_ranks(_save_quarters, 4, args=(str(root),), timeout=300, env=ENV))
    probe = _objects(root)[0]
    if posix._cachestat is None or not hasattr(os, "O_DIRECT"):
        pytest.skip(
            "this kernel cannot tell what is cached (cachestat, Linux 6.5) or has no O_DIRECT"
        )
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        pytest.skip(f"the file system of {root} has no direct I/O")
    return root


@pytest.fixture()
def answers(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What each ``PosixStorage.read_uncached`` call of the test answered."""
    seen: list[bool] = []
    real = PosixStorage.read_uncached

    def spy(self, key, start, out, length):  # type: ignore[no-untyped-def]
        got = real(self, key, start, out, length)
        seen.append(got)
        return got

    monkeypatch.setattr(PosixStorage, "read_uncached", spy)
    return seen


def _load(root: Path) -> dict[str, torch.Tensor]:
    dest = {name: torch.zeros(ROWS, COLUMNS) for name in ("a", "b")}
    ts.load(dest, root)
    return dest


def _assert_whole(dest: dict[str, torch.Tensor]) -> None:
    for name, seed in (("a", 1), ("b", 2)):
        assert torch.equal(dest[name], _full(seed)), name


def test_cold_column_pieces_come_past_the_page_cache_and_land_bitwise(quarters, answers):
    _evict(quarters)
    _assert_whole(_load(quarters))
    assert answers.count(True) >= 8, answers  # every quarter of both tensors


def test_cached_column_pieces_are_read_through_the_cache(quarters, answers):
    for path in _objects(quarters):
        path.read_bytes()
    _assert_whole(_load(quarters))
    assert answers and not any(answers), answers


def test_the_tunable_turns_direct_reads_off(quarters, answers):
    _evict(quarters)
    tunables.set_for_testing(tunables.Tunables(direct_reads=0))
    try:
        _assert_whole(_load(quarters))
    finally:
        tunables.set_for_testing(None)
    assert answers == []


def test_a_corrupt_block_read_past_the_cache_fails_the_load(quarters, tmp_path, answers):
    root = tmp_path / "copy"
    shutil.copytree(quarters, root)
    for path in _objects(root):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.chmod(0o644)
        path.write_bytes(bytes(data))
    os.sync()
    _evict(root)
    with pytest.raises(ts.CorruptError, match="fails its checksum"):
        _load(root)
    assert True in answers  # the block was read past the cache, and checked there


def _refusing_direct_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``os.open`` as on a file system without direct I/O; the paths it refused."""
    real_open = os.open
    refused: list[str] = []

    def no_direct(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECT:
            refused.append(str(path))
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    return refused


def test_a_file_system_without_direct_io_is_read_through_the_cache(quarters, answers, monkeypatch):
    refused = _refusing_direct_opens(monkeypatch)
    _evict(quarters)
    _assert_whole(_load(quarters))
    assert answers and not any(answers), answers
    # the storage stops asking at its first refusal; I/O threads already asking are refused too
    assert 1 <= len(refused) <= tunables.get().io_threads, refused


def test_a_refused_direct_open_is_not_tried_again(quarters, tmp_path, monkeypatch):
    storage = PosixStorage(tmp_path)
    storage.put("objects/ab/x", os.urandom(8192))
    _evict(tmp_path)
    refused = _refusing_direct_opens(monkeypatch)
    region = mmap.mmap(-1, 8192)
    try:
        assert not storage.read_uncached("objects/ab/x", 0, memoryview(region), 8192)
        assert not storage.read_uncached("objects/ab/x", 0, memoryview(region), 8192)
    finally:
        region.close()
    assert len(refused) == 1, refused


def test_read_uncached_reads_exactly_or_declines(quarters, tmp_path):
    storage = PosixStorage(tmp_path)
    payload = os.urandom(3 * 4096 + 100)
    storage.put("objects/ab/x", payload)
    _evict(tmp_path)
    region = mmap.mmap(-1, 5 * 4096)
    out = memoryview(region)
    try:
        assert storage.read_uncached("objects/ab/x", 0, out, len(payload))
        assert bytes(out[: len(payload)]) == payload
        assert storage.read_uncached("objects/ab/x", 4096, out, len(payload) - 4096)
        assert bytes(out[: len(payload) - 4096]) == payload[4096:]
        assert not storage.read_uncached("objects/ab/x", 100, out, 4096)  # unaligned start
        assert not storage.read_uncached("objects/ab/x", 0, out[1:], 4096)  # unaligned memory
        assert not storage.read_uncached("objects/ab/x", 0, out[:8192], 8193)  # no room
        assert not storage.read_uncached("objects/ab/x", 0, out.toreadonly(), 4096)
        with pytest.raises(ShortReadError):
            storage.read_uncached("objects/ab/x", 0, out, len(payload) + 5000)
        storage.get("objects/ab/x")  # now cached
        assert not storage.read_uncached("objects/ab/x", 0, out, len(payload))
    finally:
        out.release()
        region.close()


def test_a_link_where_an_object_should_be_is_refused_past_the_cache_too(quarters, tmp_path):
    root, outside = tmp_path / "copy", tmp_path / "outside"
    shutil.copytree(quarters, root)
    outside.mkdir()
    for path in _objects(root):
        target = outside / path.name
        shutil.copyfile(path, target)
        path.unlink()
        path.symlink_to(target)
    os.sync()
    _evict(outside)
    with pytest.raises(ts.CorruptError, match="not a regular file"):
        _load(root)
