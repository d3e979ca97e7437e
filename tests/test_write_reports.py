"""Write reports through storage (``protocol/write_reports.py``): a rank's large report is an
object of the uncommitted snapshot, the control plane carries only its size and digest, and a
stored report that is missing or changed fails the commit, naming its rank.

The ranks are threads of this process, each with a counted client of one real TCPStore (as in
``test_control_plane.py``), running the real save protocol on one POSIX root.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore
from typer.testing import CliRunner

import trainsnap as ts
from trainsnap import tunables
from trainsnap.errors import CommitFailedError
from trainsnap.manager.collection import collect
from trainsnap.protocol import save_protocol, write_reports
from trainsnap.protocol.control_plane import StoreComm, Timeouts
from trainsnap.protocol.rank_save import SaveRequest, WriteReport
from trainsnap.storage.posix import PosixStorage
from trainsnap.testing.counting_store import CountingStore
from trainsnap.testing.loopback import master_store
from trainsnap.tools.cli import app

WORLD = 3
TIMEOUTS = Timeouts(exchange=60.0, heartbeat=30.0, beat_every=0.1)


@pytest.fixture(scope="module")
def clients() -> Iterator[list[TCPStore]]:
    timeout = timedelta(seconds=30)
    master = master_store(timeout=timeout)
    yield [TCPStore("127.0.0.1", master.port, timeout=timeout) for _ in range(WORLD)]


@pytest.fixture
def small_blocks() -> Iterator[None]:
    """4 KiB checksum blocks: a rank writing 256 KiB reports 64 digests (over 1 KiB)."""
    tunables.set_for_testing(tunables.Tunables(block_size=4096))
    try:
        yield
    finally:
        tunables.set_for_testing(None)


class Recording:
    """A storage that records the keys put and read, and may tamper with reads."""

    def __init__(self, inner: PosixStorage, tamper: Callable[[str, bytes], bytes] | None = None):
        self.inner, self.tamper = inner, tamper
        self.put_keys: list[str] = []
        self.got_keys: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put(self, key: str, data: Any) -> None:
        self.put_keys.append(key)
        self.inner.put(key, data)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        self.got_keys.append(key)
        data = self.inner.get(key, start, end)
        return self.tamper(key, data) if self.tamper else data


def _state(rank: int, step: int) -> dict[str, Any]:
    rows = 64
    return {
        "w": ts.Sharded(
            torch.full((rows, 1024), float(step + rank)),  # 256 KiB a rank
            global_shape=(rows * WORLD, 1024),
            offsets=(rows * rank, 0),
        ),
        "step": step,
    }


def _save_on_threads(
    clients: list[TCPStore], storages: list[Any], step: int
) -> tuple[list[Any], list[CountingStore]]:
    """Every rank's save result (or the error it raised), and its counted store client."""
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    counted = [CountingStore(c) for c in clients]
    comms = [
        StoreComm(counted[r], r, WORLD, namespace=namespace, timeouts=TIMEOUTS)
        for r in range(WORLD)
    ]

    def body(rank: int) -> Any:
        try:
            request = SaveRequest(step=step)
            return save_protocol.run_save(_state(rank, step), storages[rank], request, comms[rank])
        except CommitFailedError as e:
            return e

    with ThreadPoolExecutor(max_workers=WORLD) as pool:
        out = [f.result(timeout=120) for f in [pool.submit(body, r) for r in range(WORLD)]]
    return out, counted


def _report_bytes(client: CountingStore) -> int:
    return client.counts.sent_by_tag["report"]


def test_large_reports_go_through_storage_and_the_control_plane_carries_a_digest(
    tmp_path, clients, small_blocks
):
    root = PosixStorage(str(tmp_path))
    storages = [Recording(root) for _ in range(WORLD)]
    results, counted = _save_on_threads(clients, storages, step=1)
    assert not any(isinstance(r, Exception) for r in results), results
    sid = results[0].outcome.snapshot_id
    for rank in range(1, WORLD):
        key = write_reports.report_key(sid, rank)
        assert storages[rank].put_keys.count(key) == 1  # each rank stored its own report
        assert key in storages[0].got_keys  # and the coordinator read it
        assert _report_bytes(counted[rank]) < 200, counted[rank].counts.sent_by_tag
    assert not [k for s in storages for k in s.put_keys if "/reports/0" in k]  # coordinator's
    # The reports went once the outcome was known: the committed snapshot is manifest + marker.
    assert sorted(root.list(f"snapshots/{sid}/")) == [
        f"snapshots/{sid}/COMMITTED",
        f"snapshots/{sid}/manifest.bin",
    ]
    assert ts.verify(str(tmp_path)).ok
    for rank in range(WORLD):
        dst = _state(rank, 0)
        ts.load(dst, str(tmp_path))
        assert torch.equal(dst["w"].local, _state(rank, 1)["w"].local) and dst["step"] == 1

    # The same save with the reports inline: the control plane carries each one whole.
    tunables.set_for_testing(tunables.Tunables(block_size=4096, report_inline_max=1 << 20))
    inline, counted = _save_on_threads(clients, [Recording(root) for _ in range(WORLD)], 2)
    assert not any(isinstance(r, Exception) for r in inline), inline
    assert all(_report_bytes(counted[r]) > 1024 for r in range(1, WORLD))


@pytest.mark.parametrize("damage", ["changed", "missing", "truncated"])
def test_a_stored_report_missing_or_changed_fails_the_commit_naming_its_rank(
    tmp_path, clients, small_blocks, damage
):
    root = PosixStorage(str(tmp_path))

    def tamper(key: str, data: bytes) -> bytes:
        if not key.endswith("/reports/1"):
            return data
        if damage == "missing":
            root.delete(key)
            raise FileNotFoundError(key)
        if damage == "truncated":
            return data[:-1]
        return data[:-1] + bytes([data[-1] ^ 1])  # one digest bit of the last object

    storages = [Recording(root, tamper), Recording(root), Recording(root)]
    results, _ = _save_on_threads(clients, storages, step=3)
    for rank, result in enumerate(results):
        assert isinstance(result, CommitFailedError), (rank, result)
        assert set(result.rank_errors) == {1}, result.rank_errors
        assert "rank 1:" in str(result), str(result)
        why = "missing" if damage == "missing" else "changed or truncated"
        assert why in result.rank_errors[1], result.rank_errors[1]
    assert ts.list_snapshots(str(tmp_path)) == []
    sid = results[0].snapshot_id
    assert list(root.list(write_reports.reports_prefix(sid))) == []  # deleted on failure too


def test_reports_left_in_a_committed_snapshot_are_invisible_and_collected(tmp_path):
    """A coordinator that died between its marker and deleting the reports leaves them in a
    committed snapshot's directory: listing, verification and loading ignore them, and the
    collector removes them once past its grace period (never the snapshot)."""
    root = str(tmp_path)
    info = ts.save({"x": torch.arange(10.0), "step": 5}, root, step=5)
    storage = PosixStorage(root)
    key = write_reports.report_key(info.id, 1)
    storage.put(key, write_reports.encode(WriteReport(bytes_new=1)))
    # An interrupted save that stored only its reports: uncommitted, never listed.
    lost = write_reports.report_key("step-000000000006-0badcafe", 2)
    storage.put(lost, b"anything")
    assert [s.id for s in ts.list_snapshots(root)] == [info.id]
    assert ts.verify(root).ok
    for args in (["ls", root, "--verify"], ["show", root, "latest"], ["show", root, info.id]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, (args, res.output)
        assert "reports" not in res.output and "0badcafe" not in res.output, res.output
    young = collect(storage, grace=3600.0)
    assert young.reports_deleted == 0 and storage.stat(key) > 0
    report = collect(storage, grace=None)
    assert report.reports_deleted == 1
    assert report.uncommitted_deleted == ["step-000000000006-0badcafe"]
    assert list(storage.list("snapshots/step-000000000006-0badcafe/")) == []
    assert list(storage.list(write_reports.reports_prefix(info.id))) == []
    dst = {"x": torch.zeros(10), "step": 0}
    ts.load(dst, root)
    assert torch.equal(dst["x"], torch.arange(10.0)) and dst["step"] == 5


def test_reports_round_trip_and_anything_else_is_refused() -> None:
    report = WriteReport(
        objects=[
            ("a" * 40, 10, b"d" * 32, "raw", 10, (), b""),
            ("b" * 40, 9, b"e" * 16, "zstd", 4, (4,), b"f" * 16),
        ],
        entries=[(0, -1, [(0, 0, 10)])],
        values=[(2, 1, [(1, 0, 9)])],
        bytes_new=14,
    )
    data = write_reports.encode(report)
    assert write_reports.decode(data) == report
    failed = WriteReport(error="disk full")
    assert write_reports.decode(write_reports.encode(failed)) == failed
    for bad in [
        b"",
        data[:-1],
        data + b"x",
        b"\x89TSRPT1\n" + data[8:12],
        data.replace(b"10", b"-1"),
    ]:
        with pytest.raises(ts.CorruptError):
            write_reports.decode(bad)
