"""Storage backend conformance: one suite that every backend must pass the same way.

The snapshot engine relies only on the protocol in ``trainsnap.storage.base``; these tests pin
that protocol down (exact bytes, exact errors, exact listings) on a POSIX directory, an fsspec
``memory://`` root and S3 served by a loopback moto server, so that a backend which drifts from
the others fails here rather than as a corrupt or unreadable snapshot later.
"""

from __future__ import annotations

import os
import random
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import trainsnap as ts
from s3_fixture import S3Root, bucket_keys
from trainsnap import faults
from trainsnap.errors import InvalidArgumentError
from trainsnap.storage import PosixStorage, Storage, open_storage
from trainsnap.storage.base import ShortReadError

BAD_KEYS = ["../x", "/abs", "a//b", ".hidden/x", "a/./b", ""]


@dataclass(frozen=True)
class Backend:
    """A storage under test and a view of everything around it (to prove nothing leaked)."""

    name: str
    storage: Storage
    surroundings: Callable[[], set[str]]


def _payload(n: int, seed: int = 0) -> bytes:
    """Deterministic, incompressible bytes, so that a misplaced range cannot match by luck."""
    return random.Random(seed).randbytes(n)


def _tree(top: Path) -> set[str]:
    """Every file and directory under ``top``, relative to it."""
    return {p.relative_to(top).as_posix() for p in top.rglob("*")}


def _posix_backend(tmp_path: Path) -> Backend:
    return Backend("posix", PosixStorage(tmp_path / "root"), lambda: _tree(tmp_path))


def _memory_backend() -> Iterator[Backend]:
    import fsspec

    name = f"ts-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("memory")
    yield Backend(
        "memory",
        open_storage(f"memory://{name}"),
        lambda: set(fs.store) | set(fs.pseudo_dirs),
    )
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)  # the memory store is process-global


def _s3_backend(root: S3Root) -> Backend:
    return Backend("s3", root.open(), lambda: bucket_keys(root.endpoint))


@pytest.fixture(params=["posix", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each conformance test runs once per backend, on an empty root of its own."""
    if request.param == "posix":
        yield _posix_backend(tmp_path)
    elif request.param == "memory":
        yield from _memory_backend()
    else:
        yield _s3_backend(request.getfixturevalue("s3_root"))


@pytest.fixture
def storage(backend: Backend) -> Storage:
    return backend.storage


@pytest.fixture
def posix(tmp_path: Path) -> PosixStorage:
    return PosixStorage(tmp_path / "root")


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "list"])
def test_put_get_round_trip(storage: Storage, kind: str) -> None:
    data = _payload(3000, seed=1)
    given = {
        "bytes": data,
        "bytearray": bytearray(data),
        "memoryview": memoryview(data),
        "list": [data[:1000], bytearray(data[1000:1001]), memoryview(data)[1001:], b""],
    }[kind]
    storage.put("objects/ab/abcdef", given)
    assert storage.get("objects/ab/abcdef") == data
    assert storage.stat("objects/ab/abcdef") == len(data)


def test_memoryview_of_other_format_is_stored_as_raw_bytes(storage: Storage) -> None:
    """Tensors reach put as typed memoryviews; their bytes, not their items, are stored."""
    words = memoryview(bytearray(_payload(64, seed=2))).cast("I")
    storage.put("objects/ab/typed", words)
    assert storage.get("objects/ab/typed") == words.tobytes()


def test_ranged_get(storage: Storage) -> None:
    data = _payload(1000, seed=3)
    storage.put("objects/ab/r", data)
    assert storage.get("objects/ab/r", 0, 10) == data[:10]
    assert storage.get("objects/ab/r", 123, 456) == data[123:456]
    assert storage.get("objects/ab/r", 990, 1000) == data[990:]
    assert storage.get("objects/ab/r", 500) == data[500:]


def test_zero_length_reads(storage: Storage) -> None:
    """An empty range is empty, wherever it starts (an empty tensor reads nothing)."""
    storage.put("objects/ab/z", b"0123456789")
    assert storage.get("objects/ab/z", 5, 5) == b""
    storage.read_into("objects/ab/z", 5, memoryview(bytearray(0)))


def test_read_into_at_offset(storage: Storage) -> None:
    data = _payload(200, seed=4)
    storage.put("objects/ab/ri", data)
    buf = bytearray(b"\xee" * 40)
    storage.read_into("objects/ab/ri", 10, memoryview(buf)[4:20])
    assert buf == b"\xee" * 4 + data[10:26] + b"\xee" * 20


def test_empty_object(storage: Storage) -> None:
    storage.put("objects/00/empty", b"")
    assert storage.get("objects/00/empty") == b""
    assert storage.get("objects/00/empty", 0, 0) == b""
    assert storage.stat("objects/00/empty") == 0
    assert list(storage.list("objects/")) == ["objects/00/empty"]


def test_large_object(storage: Storage) -> None:
    data = _payload(8 << 20, seed=5)
    half = len(data) // 2
    storage.put("objects/ff/big", [memoryview(data)[:half], memoryview(data)[half:]])
    assert storage.stat("objects/ff/big") == len(data)
    assert storage.get("objects/ff/big") == data
    assert storage.get("objects/ff/big", half - 7, half + 4096) == data[half - 7 : half + 4096]
    out = bytearray(1 << 20)
    storage.read_into("objects/ff/big", 3 << 20, memoryview(out))
    assert out == data[3 << 20 : 4 << 20]


# -- missing keys and short objects ------------------------------------------------------------


def test_missing_key_is_file_not_found(storage: Storage) -> None:
    with pytest.raises(FileNotFoundError):
        storage.get("objects/ab/missing")
    with pytest.raises(FileNotFoundError):
        storage.get("objects/ab/missing", 0, 4)
    with pytest.raises(FileNotFoundError):
        storage.stat("objects/ab/missing")
    with pytest.raises(FileNotFoundError):
        storage.read_into("objects/ab/missing", 0, memoryview(bytearray(4)))


def test_directory_like_key_is_not_an_object(storage: Storage) -> None:
    """``objects/ab`` holds objects but is not one: stat must not report a size for it."""
    storage.put("objects/ab/child", b"x")
    with pytest.raises(FileNotFoundError):
        storage.stat("objects/ab")


@pytest.mark.parametrize(("start", "length"), [(90, 20), (100, 1), (150, 8)])
def test_read_past_end_is_short_read(storage: Storage, start: int, length: int) -> None:
    storage.put("objects/ab/short", _payload(100, seed=6))
    assert issubclass(ShortReadError, OSError)
    with pytest.raises(ShortReadError):
        storage.read_into("objects/ab/short", start, memoryview(bytearray(length)))
    with pytest.raises(ShortReadError):
        storage.get("objects/ab/short", start, start + length)


# -- listing -----------------------------------------------------------------------------------

LAYOUT = [
    "objects/ab/abcd01",
    "objects/ab/abcd02",
    "objects/cd/cdef01",
    "objects-old/ab/abcd01",
    "snapshots/step-000000000003-aaaaaaaa/manifest.json",
    "snapshots/step-000000000003-aaaaaaaa/COMMITTED",
    "snapshots/step-000000000004-bbbbbbbb/manifest.json",
]


def _fill(storage: Storage, keys: list[str]) -> None:
    for i, key in enumerate(keys):
        storage.put(key, f"content of {key} #{i}".encode())


def test_list_by_prefix(storage: Storage) -> None:
    _fill(storage, LAYOUT)
    assert sorted(storage.list("")) == sorted(LAYOUT)
    assert sorted(storage.list("objects/")) == LAYOUT[:3]
    assert sorted(storage.list("objects/ab/")) == LAYOUT[:2]
    assert sorted(storage.list("snapshots/step-000000000003-aaaaaaaa/")) == sorted(LAYOUT[4:6])
    assert sorted(storage.list("snapshots/")) == sorted(LAYOUT[4:])


def test_list_missing_prefix_is_empty(storage: Storage) -> None:
    assert list(storage.list("")) == []
    assert list(storage.list("snapshots/")) == []
    _fill(storage, LAYOUT)
    assert list(storage.list("nothing/")) == []
    assert list(storage.list("objects/zz/")) == []


def test_list_never_shows_temporary_files(posix: PosixStorage) -> None:
    """Leftovers of an interrupted write are the collector's business, not a reader's."""
    _fill(posix, LAYOUT[:1])
    leftover = posix.root / "objects/ab/.abcd02.tmp-123-deadbeef"
    leftover.write_bytes(b"partial")
    (posix.root / ".hidden").mkdir()
    (posix.root / ".hidden/x").write_bytes(b"x")
    assert sorted(posix.list("")) == LAYOUT[:1]
    assert sorted(posix.list("objects/ab/")) == LAYOUT[:1]
    assert list(posix.list_temporaries()) == [str(leftover)]


# -- delete and overwrite ----------------------------------------------------------------------


def test_delete_is_idempotent_and_complete(storage: Storage) -> None:
    _fill(storage, LAYOUT)
    storage.delete("objects/ab/never-written")
    for key in (LAYOUT[0], LAYOUT[4], LAYOUT[5]):
        storage.delete(key)
        storage.delete(key)
        with pytest.raises(FileNotFoundError):
            storage.get(key)
        with pytest.raises(FileNotFoundError):
            storage.stat(key)
    remaining = [k for k in LAYOUT if k not in (LAYOUT[0], LAYOUT[4], LAYOUT[5])]
    assert sorted(storage.list("")) == sorted(remaining)
    assert list(storage.list("snapshots/step-000000000003-aaaaaaaa/")) == []
    assert storage.get(LAYOUT[1]) == f"content of {LAYOUT[1]} #1".encode()


def test_overwrite_replaces_whole_content(storage: Storage) -> None:
    storage.put("snapshots/s/manifest.json", _payload(5000, seed=7))
    storage.put("snapshots/s/manifest.json", b"short")
    assert storage.get("snapshots/s/manifest.json") == b"short"
    assert storage.stat("snapshots/s/manifest.json") == 5
    assert list(storage.list("snapshots/")) == ["snapshots/s/manifest.json"]


def test_concurrent_identical_puts(storage: Storage) -> None:
    """Ranks that dedupe to the same content-addressed object may write it at the same time."""
    data = _payload(256 << 10, seed=8)
    gate = threading.Barrier(8)

    def put() -> None:
        gate.wait(timeout=30)
        storage.put("objects/ab/same", data)

    with ThreadPoolExecutor(8) as pool:
        for f in [pool.submit(put) for _ in range(8)]:
            f.result()
    assert storage.get("objects/ab/same") == data
    assert list(storage.list("")) == ["objects/ab/same"]


# -- key validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_are_refused(backend: Backend, key: str) -> None:
    storage = backend.storage
    storage.put("objects/ab/keep", b"keep")
    before = backend.surroundings()
    operations: list[Callable[[], object]] = [
        lambda: storage.put(key, b"evil"),
        lambda: storage.get(key),
        lambda: storage.get(key, 0, 1),
        lambda: storage.stat(key),
        lambda: storage.read_into(key, 0, memoryview(bytearray(1))),
        lambda: storage.delete(key),
    ]
    for op in operations:
        with pytest.raises(InvalidArgumentError):
            op()
    assert backend.surroundings() == before
    assert list(storage.list("")) == ["objects/ab/keep"]


@pytest.mark.parametrize("prefix", ["../", "/abs/", "a//b/", ".hidden/", "a/../"])
def test_bad_prefixes_are_refused(storage: Storage, prefix: str) -> None:
    with pytest.raises(InvalidArgumentError):
        list(storage.list(prefix))


# -- POSIX durability --------------------------------------------------------------------------


def test_interrupted_put_leaves_nothing(posix: PosixStorage) -> None:
    faults.install("mid_write=raise")
    with pytest.raises(faults.InjectedFault):
        posix.put("objects/ab/interrupted", _payload(10_000, seed=9))
    with pytest.raises(FileNotFoundError):
        posix.get("objects/ab/interrupted")
    assert list(posix.list("")) == []
    assert list(posix.list_temporaries()) == []
    assert [p for p in posix.root.rglob("*") if p.is_file()] == []


def test_interrupted_overwrite_keeps_previous_content(posix: PosixStorage) -> None:
    posix.put("snapshots/s/manifest.json", b"previous")
    faults.install("mid_write=raise")
    with pytest.raises(faults.InjectedFault):
        posix.put("snapshots/s/manifest.json", _payload(10_000, seed=10))
    assert posix.get("snapshots/s/manifest.json") == b"previous"
    assert os.listdir(posix.root / "snapshots/s") == ["manifest.json"]


def test_put_is_complete_on_disk(posix: PosixStorage) -> None:
    data = _payload(70_000, seed=11)
    posix.put("objects/ab/disk", [data[:5], data[5:]])
    path = posix.root / "objects/ab/disk"
    assert path.read_bytes() == data
    assert path.stat().st_size == len(data)
    assert os.listdir(path.parent) == ["disk"]


# -- end to end through the public API ---------------------------------------------------------


def test_save_list_load_verify(storage: Storage) -> None:
    torch.manual_seed(0)
    src = {"w": torch.randn(300, 70), "cfg": {"lr": 0.1}}
    info = ts.save(src, storage, step=3)
    assert info.step == 3

    listed = ts.list_snapshots(storage)
    assert [(s.id, s.step) for s in listed] == [(info.id, 3)]

    dst = {"w": torch.zeros(300, 70), "cfg": {"lr": 0.0}}
    ts.load(dst, storage)
    assert dst["w"].numpy().tobytes() == src["w"].numpy().tobytes()
    assert dst["cfg"] == {"lr": 0.1}

    report = ts.verify(storage)
    assert report.ok
    assert [s.id for s in report.snapshots] == [info.id]


@pytest.mark.s3
def test_loopback_s3_counts_the_body_bytes_it_serves(s3_root: S3Root) -> None:
    """What ``benchmarks.replica_reads`` counts as pulled: every body byte of a GET, whole or
    ranged, and nothing for a PUT or a HEAD."""
    from trainsnap.testing.s3 import SERVED_PATH, served

    storage, count = s3_root.open(), s3_root.endpoint + SERVED_PATH
    before = served(count)
    storage.put("blob", bytes(range(256)) * 40)
    storage.stat("blob")
    assert served(count) == before
    assert len(storage.get("blob")) == 10240
    assert served(count) == before + 10240
    assert storage.get("blob", 100, 1100) == (bytes(range(256)) * 40)[100:1100]
    assert served(count) == before + 11240
