"""Column pieces read straight into destination rows, blocks verified as they land, and the task
runner that lets reads start while a load is still planning."""

from __future__ import annotations

import itertools
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import trainsnap as ts
from trainsnap import tunables
from trainsnap.engine import read_plan
from trainsnap.engine.buffers import Parts
from trainsnap.engine.pool import TaskRunner, run_all
from trainsnap.format.checksums import Hasher
from trainsnap.storage.base import read_steps
from trainsnap.storage.posix import PosixStorage
from trainsnap.testing import assert_all_ok, run_ranks

ROWS = 40
# float32 columns: rows of 16 KiB, 4 KiB and 64 bytes per saved quarter
WIDER, WIDE, NARROW = 16384, 4096, 64
# Blocks that do not divide a row, chunks of a few blocks: pieces start and end mid-block.
ENV = {"TRAINSNAP_BLOCK_SIZE": str(12352), "TRAINSNAP_CHUNK_SIZE": str(12352 * 5)}


def _full(columns: int, seed: int) -> torch.Tensor:
    return torch.randn(ROWS, columns, generator=torch.Generator().manual_seed(seed))


def _save_quarters(rank: int, world: int, root: str) -> None:
    state = {}
    for name, columns, seed in (("wide", WIDE, 1), ("narrow", NARROW, 2), ("wider", WIDER, 3)):
        width = columns // world
        local = _full(columns, seed)[:, rank * width : (rank + 1) * width].clone()
        state[name] = ts.Sharded(local, global_shape=(ROWS, columns), offsets=(0, rank * width))
    ts.save(state, root, step=1, timeout=120)


@pytest.fixture(scope="module")
def column_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A snapshot whose two tensors were saved as four column quarters by four ranks."""
    root = tmp_path_factory.mktemp("columns")
    assert_all_ok(run_ranks(_save_quarters, 4, args=(str(root),), timeout=300, env=ENV))
    return root


def test_column_quarters_land_in_their_rows_in_place_or_through_small_windows(
    column_root, monkeypatch
):
    """Rows of 16 KiB or more are read straight into place; shorter ones a window at a time
    (verified, then copied from the cache): never through a bounce buffer the size of the piece,
    never with the strided copy of a whole piece."""
    from trainsnap.engine.buffers import BouncePool, Rows

    filled: set[int] = set()
    asked: list[int] = []
    copied: list[object] = []
    real_fill, real_buffer = Rows.fill, BouncePool.buffer

    def fill(self, start, data):  # type: ignore[no-untyped-def]
        filled.add(self.out.data_ptr())
        real_fill(self, start, data)

    def buffer(self, nbytes):  # type: ignore[no-untyped-def]
        asked.append(nbytes)
        return real_buffer(self, nbytes)

    monkeypatch.setattr(Rows, "fill", fill)
    monkeypatch.setattr(BouncePool, "buffer", buffer)
    monkeypatch.setattr(read_plan, "_strided_copy", lambda *a: copied.append(a))
    dest = {name: torch.zeros(ROWS, n) for name, n in (("wide", WIDE), ("narrow", NARROW))}
    dest["wider"] = torch.zeros(ROWS, WIDER)
    ts.load(dest, column_root)
    for name, columns, seed in (("wide", WIDE, 1), ("narrow", NARROW, 2), ("wider", WIDER, 3)):
        assert torch.equal(dest[name], _full(columns, seed)), name
    assert filled == {dest["wide"].data_ptr(), dest["narrow"].data_ptr()}
    assert copied == []
    window = max(tunables.get().read_window, int(ENV["TRAINSNAP_BLOCK_SIZE"]))
    assert asked and set(asked) == {window}


@pytest.mark.parametrize("seed", range(6))
def test_rows_fill_a_strided_box_from_windows_cut_anywhere(seed: int) -> None:
    """Source bytes of a 3-D box of a bigger tensor, in row-major order, arriving in windows cut
    at random (elements and rows straddle them): each byte lands where its element belongs."""
    from trainsnap.engine.buffers import Rows, raw_bytes

    rng = random.Random(seed)
    dtype = (torch.float32, torch.bfloat16, torch.float64)[seed % 3]
    whole = torch.zeros(5, 7, 9, dtype=dtype)
    box = (slice(1, 4), slice(2, 7), slice(3, 8))
    source = torch.randn(3, 5, 5, generator=torch.Generator().manual_seed(seed)).to(dtype)
    data = memoryview(source.contiguous().view(torch.uint8).numpy()).cast("B")
    offset = 1 * 63 + 2 * 9 + 3
    rows = Rows((3, 5, 5), whole.stride(), offset, whole.element_size(), raw_bytes(whole))
    cuts = sorted(rng.sample(range(1, len(data)), 9))
    for lo, hi in itertools.pairwise([0, *cuts, len(data)]):
        rows.fill(lo, data[lo:hi])
    expected = torch.zeros_like(whole)
    expected[box] = source
    assert torch.equal(whole, expected)


def test_half_of_the_rows_of_the_columns(column_root):
    """A destination that is itself a box (rows 10..30, all columns): strided on both counts."""
    dst = torch.zeros(20, WIDE)
    ts.load({"wide": ts.Sharded(dst, global_shape=(ROWS, WIDE), offsets=(10, 0))}, column_root)
    assert torch.equal(dst, _full(WIDE, 1)[10:30])


@pytest.mark.parametrize("key", ["wider", "wide", "narrow"])  # in place, windows, windows
def test_a_corrupt_block_under_a_column_piece_fails_the_load(column_root, tmp_path, key):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(column_root, root)
    for path in (p for p in (root / "objects").rglob("*") if p.is_file()):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.chmod(0o644)
        path.write_bytes(bytes(data))
    columns = {"wider": WIDER, "wide": WIDE, "narrow": NARROW}[key]
    with pytest.raises(ts.CorruptError, match="fails its checksum"):
        ts.load({key: torch.zeros(ROWS, columns)}, root)


def test_read_steps_fills_scatter_lists_in_order_and_stops_when_told(tmp_path):
    storage = PosixStorage(tmp_path)
    payload = bytes(range(256)) * 40
    storage.put("objects/ab/x", payload)
    out = bytearray(len(payload) - 100)
    parts = Parts([memoryview(out)[i : i + 700] for i in range(0, len(out), 700)])
    steps = [parts.take(min(1000, len(out) - i)) for i in range(0, len(out), 1000)]
    seen: list[int] = []
    read_steps(storage, "objects/ab/x", 100, steps, seen.append)
    assert bytes(out) == payload[100:] and seen == list(range(len(steps)))

    def stop_at_two(i: int) -> None:
        if i == 2:
            raise ValueError("bad block")

    out[:] = bytes(len(out))
    with pytest.raises(ValueError, match="bad block"):
        read_steps(storage, "objects/ab/x", 100, steps, stop_at_two)
    assert bytes(out[3000:]) == bytes(len(out) - 3000)  # nothing read after the failed step


def test_digest_of_parts_is_the_digest_of_their_concatenation():
    data = bytes(range(256)) * 13
    for algorithm in ("xxh3-128", "sha256"):
        hasher = Hasher(algorithm)
        parts = [memoryview(data)[:5], memoryview(data)[5:3000], memoryview(data)[3000:]]
        assert hasher.digest_parts(parts) == hasher.digest(data)


def test_task_runner_stops_on_the_first_failure_and_waits_for_running_tasks():
    started, finished = [], []
    lock = threading.Lock()

    def slow(i: int) -> int:
        with lock:
            started.append(i)
        time.sleep(0.05)
        with lock:
            finished.append(i)
        return i

    def fail() -> int:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"), TaskRunner[int](2) as runner:
        runner.submit(fail)
        time.sleep(0.02)
        for i in range(50):
            runner.submit(lambda i=i: slow(i))
    assert sorted(started) == sorted(finished)  # nothing still running after the block
    assert len(started) < 50
    assert run_all([lambda i=i: i * i for i in range(10)], 4) == [i * i for i in range(10)]


def test_task_runners_share_the_process_pool_and_nest():
    """Runners reuse one pool's threads (a start costs milliseconds); a task that runs tasks of
    its own gets its own pool (on the shared one it could wait for the thread it holds)."""

    def names(count: int) -> set[str]:
        with TaskRunner[str](2) as runner:
            for _ in range(count):
                runner.submit(lambda: (time.sleep(0.01), threading.current_thread().name)[1])
        return set(runner.results())

    first, second = names(6), names(6)
    assert first == second and len(first) == 2
    nested = run_all([lambda: run_all([lambda: 1, lambda: 2], 2) for _ in range(2)], 2)
    assert nested == [[1, 2], [1, 2]]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_pool_of_its_own():
    assert run_all([lambda: 1, lambda: 2], 2) == [1, 2]  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # the child: the inherited pool has no threads
        signal.alarm(60)  # a child stuck on them dies instead of hanging the test
        os._exit(0 if run_all([lambda: 1, lambda: 2], 2) == [1, 2] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_parts_take_hands_out_the_next_bytes_in_order_across_any_cuts() -> None:
    """Random buffers (empty ones among them) over random bytes, taken in random amounts: each
    take's views hold exactly the next bytes; taking past the end raises."""
    rng = random.Random(7)
    for _ in range(2000):
        data = bytearray(rng.randbytes(rng.randrange(0, 300)))
        cuts = sorted(
            [0, len(data), *(rng.randrange(len(data) + 1) for _ in range(rng.randrange(8)))]
        )
        parts = Parts([memoryview(data)[a:b] for a, b in itertools.pairwise(cuts)])
        pos = 0
        while pos < len(data):
            n = rng.randrange(len(data) - pos + 1)
            views = parts.take(n)
            assert b"".join(bytes(v) for v in views) == bytes(data[pos : pos + n])
            pos += n
        with pytest.raises(ValueError, match="past the end"):
            parts.take(1)


def test_column_pieces_cut_into_many_window_copies_read_each_block_once(column_root):
    """Pieces cut into spans far smaller than a block (``copy_max``) share their edge blocks
    with the next span: each such block is read and verified once, then kept for the next (one
    I/O thread: spans read at once on two threads may both find the block not yet kept)."""
    from trainsnap.storage.posix import PosixStorage
    from trainsnap.testing.counting_store import CountingStorage

    stored = sum(p.stat().st_size for p in (column_root / "objects").rglob("*") if p.is_file())
    tunables.set_for_testing(tunables.Tunables(copy_max=3000, io_threads=1))
    try:
        storage = CountingStorage(PosixStorage(str(column_root)))
        dest = {name: torch.zeros(ROWS, n) for name, n in (("wide", WIDE), ("narrow", NARROW))}
        dest["wider"] = torch.zeros(ROWS, WIDER)
        ts.load(dest, storage)
    finally:
        tunables.set_for_testing(None)
    for name, columns, seed in (("wide", WIDE, 1), ("narrow", NARROW, 2), ("wider", WIDER, 3)):
        assert torch.equal(dest[name], _full(columns, seed)), name
    assert storage.bytes_read - storage.metadata_bytes <= stored
