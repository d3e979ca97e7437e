"""Storage backend conformance: one suite that every backend must pass the same way.

The snapshot engine relies only on the protocol in ``trainsnap.storage.base``; these tests pin
that protocol down (exact bytes, exact errors, exact listings, conditional creates) on a POSIX
directory, an fsspec ``memory://`` root, S3 served by a loopback moto server, S3 served by a
real S3 server (SeaweedFS), Azure Blob served by Azurite (Microsoft's emulator) and Google Cloud
Storage served by fake-gcs-server, so that a backend which drifts from the others fails here
rather than as a corrupt or unreadable snapshot, or an unfenced writer, later.
"""

from __future__ import annotations

import os
import random
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import trainsnap as ts
from s3_fixture import AzRoot, GcsRoot, S3Root, bucket_keys, container_blobs, gcs_objects, gcs_put
from trainsnap import faults
from trainsnap.errors import InvalidArgumentError
from trainsnap.storage import PosixStorage, Storage, open_storage
from trainsnap.storage.base import ShortReadError
from trainsnap.storage.fsspec import FsspecStorage

BAD_KEYS = ["../x", "/abs", "a//b", ".hidden/x", "a/./b", ""]


@dataclass(frozen=True)
class Backend:
    """A storage under test and a view of everything around it (to prove nothing leaked)."""

    name: str
    storage: Storage
    surroundings: Callable[[], set[str]]
    make_folder: Callable[[str], None]
    """Make what the store's own tools make for an empty "folder" ``prefix/`` (a directory, a
    zero-byte ``prefix/`` object) without going through the backend under test."""


def _payload(n: int, seed: int = 0) -> bytes:
    """Deterministic, incompressible bytes, so that a misplaced range cannot match by luck."""
    return random.Random(seed).randbytes(n)


def _tree(top: Path) -> set[str]:
    """Every file and directory under ``top``, relative to it."""
    return {p.relative_to(top).as_posix() for p in top.rglob("*")}


def _posix_backend(tmp_path: Path) -> Backend:
    def make_folder(prefix: str) -> None:
        (tmp_path / "root" / prefix).mkdir(parents=True, exist_ok=True)

    return Backend("posix", PosixStorage(tmp_path / "root"), lambda: _tree(tmp_path), make_folder)


def _memory_backend() -> Iterator[Backend]:
    import fsspec

    name = f"ts-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("memory")
    yield Backend(
        "memory",
        open_storage(f"memory://{name}"),
        lambda: set(fs.store) | set(fs.pseudo_dirs),
        lambda prefix: fs.mkdir(f"/{name}/{prefix}"),
    )
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)  # the memory store is process-global


def _s3_backend(name: str, root: S3Root) -> Backend:
    import boto3

    def make_folder(prefix: str) -> None:
        client = boto3.client("s3", endpoint_url=root.endpoint, region_name="us-east-1")
        bucket, _, top = root.url.removeprefix("s3://").partition("/")
        client.put_object(Bucket=bucket, Key=f"{top}/{prefix.rstrip('/')}/", Body=b"")

    return Backend(name, root.open(), lambda: bucket_keys(root.endpoint), make_folder)


def _az_backend(root: AzRoot) -> Backend:
    from azure.storage.blob import BlobServiceClient

    from trainsnap.testing.azurite import CONTAINER, connection_string

    def make_folder(prefix: str) -> None:
        # What Hadoop's connectors and Azure tools leave for a directory on a flat namespace.
        client = BlobServiceClient.from_connection_string(connection_string(root.endpoint))
        top = root.url.removeprefix(f"az://{CONTAINER}/")
        client.get_blob_client(CONTAINER, f"{top}/{prefix.rstrip('/')}/").upload_blob(
            b"", metadata={"hdi_isfolder": "true"}
        )

    return Backend("az", root.open(), lambda: container_blobs(root.endpoint), make_folder)


def _gcs_backend(root: GcsRoot) -> Backend:
    from trainsnap.testing.gcs import BUCKET

    def make_folder(prefix: str) -> None:
        # The zero-byte ``prefix/`` object the console's "create folder" leaves.
        top = root.url.removeprefix(f"gs://{BUCKET}/")
        gcs_put(root.endpoint, f"{top}/{prefix.rstrip('/')}/", b"")

    return Backend("gcs", root.open(), lambda: gcs_objects(root.endpoint), make_folder)


S3_BACKENDS = {"s3": "s3_root", "seaweedfs": "seaweed_root"}
"""S3 backends and the fixture giving each a fresh root: moto, and a real S3 server."""


@pytest.fixture(
    params=[
        "posix",
        "memory",
        *(pytest.param(name, marks=pytest.mark.s3) for name in S3_BACKENDS),
        pytest.param("az", marks=pytest.mark.az),
        pytest.param("gcs", marks=pytest.mark.gcs),
    ]
)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each conformance test runs once per backend, on an empty root of its own."""
    if request.param == "posix":
        yield _posix_backend(tmp_path)
    elif request.param == "memory":
        yield from _memory_backend()
    elif request.param == "az":
        yield _az_backend(request.getfixturevalue("az_root"))
    elif request.param == "gcs":
        yield _gcs_backend(request.getfixturevalue("gcs_root"))
    else:
        root = request.getfixturevalue(S3_BACKENDS[request.param])
        yield _s3_backend(request.param, root)


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


def _fsspec_of(storage: Storage) -> FsspecStorage | None:
    """The fsspec backend under the retrying (and fault-injecting) wrappers, if it is one."""
    while not isinstance(storage, FsspecStorage):
        inner = getattr(storage, "inner", None)
        if inner is None:
            return None
        storage = inner
    return storage


def test_large_object(backend: Backend) -> None:
    """Big enough to go up in parts (multipart upload on S3, parts of 5 MiB, S3's least;
    staged blocks on Azure; a resumable upload in chunks on GCS)."""
    storage = backend.storage
    fsspec_backend = _fsspec_of(storage)
    if fsspec_backend is not None:
        fsspec_backend.part_size = 5 << 20
    data = _payload(12 << 20, seed=5)
    half = len(data) // 2
    storage.put("objects/ff/big", [memoryview(data)[:half], memoryview(data)[half:]])
    assert storage.stat("objects/ff/big") == len(data)
    assert storage.get("objects/ff/big") == data
    assert storage.get("objects/ff/big", half - 7, half + 4096) == data[half - 7 : half + 4096]
    out = bytearray(1 << 20)
    storage.read_into("objects/ff/big", 3 << 20, memoryview(out))
    assert out == data[3 << 20 : 4 << 20]
    if backend.name in S3_BACKENDS:
        assert fsspec_backend is not None
        etag = fsspec_backend.fs.info(fsspec_backend._path("objects/ff/big"))["ETag"]
        assert etag.strip('"').endswith("-3"), f"not a 3-part upload: ETag {etag}"
    if backend.name == "az":
        assert fsspec_backend is not None
        blocks = _az_committed_blocks(fsspec_backend, "objects/ff/big")
        assert blocks == 3, f"not a 3-block upload: {blocks} committed blocks"


def _az_committed_blocks(storage: FsspecStorage, key: str) -> int:
    """How many blocks the Azure blob ``key`` was committed from (0: one Put Blob)."""
    from azure.storage.blob import BlobClient

    container, _, blob = storage._path(key).partition("/")
    client = BlobClient.from_connection_string(storage.fs.connection_string, container, blob)
    committed, _ = client.get_block_list("committed")
    return len(committed)


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


def test_mtime_is_the_time_of_the_last_write(storage: Storage) -> None:
    """The collector's grace period reads it: an object written now must not look old (an
    unread time taken as the epoch would let the collector delete a save's fresh objects)."""
    before = time.time()
    storage.put("objects/ab/timed", b"x")
    written = storage.mtime("objects/ab/timed")
    assert before - 2 <= written <= time.time() + 2, (before, written)
    with pytest.raises(FileNotFoundError):
        storage.mtime("objects/ab/never-written")


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


# -- conditional creates (the writer generations that fence a superseded job) ----------------


def test_conditional_create(storage: Storage) -> None:
    assert storage.put_if_absent("lease/gen-000000000001", b"first") is True
    assert storage.put_if_absent("lease/gen-000000000001", b"second") is False
    assert storage.get("lease/gen-000000000001") == b"first"
    storage.put("objects/ab/plain", b"plain")
    assert storage.put_if_absent("objects/ab/plain", b"other") is False
    assert storage.get("objects/ab/plain") == b"plain"


def test_concurrent_conditional_creates_have_one_winner(storage: Storage) -> None:
    """N creators of one key at once: exactly one gets True and its bytes are stored; every
    other gets False, never an error (a raw error would abort a job's lease take)."""
    creators = 8
    for round_ in range(3):
        key = f"lease/gen-{round_ + 1:012d}"
        gate = threading.Barrier(creators)

        def create(i: int, key: str = key, gate: threading.Barrier = gate) -> bool:
            gate.wait(timeout=30)
            return storage.put_if_absent(key, f"creator {i}".encode())

        with ThreadPoolExecutor(creators) as pool:
            won = [f.result() for f in [pool.submit(create, i) for i in range(creators)]]
        assert won.count(True) == 1, won
        assert storage.get(key) == f"creator {won.index(True)}".encode()


def test_retried_operations_are_idempotent(storage: Storage) -> None:
    """Each operation done, then its answer lost (a reset connection), then retried: the
    result is what one call gives. A create whose first answer was lost still wins once."""
    from trainsnap.storage.retry import RetryingStorage

    raw = getattr(storage, "inner", storage)
    lossy = RetryingStorage(_LoseFirstAnswer(raw), base_delay=0.001)
    data = _payload(5000, seed=12)
    lossy.put("objects/ab/retried", data)
    assert lossy.get("objects/ab/retried") == data
    assert lossy.stat("objects/ab/retried") == 5000
    assert lossy.put_if_absent("lease/gen-000000000007", b"mine") is True
    assert lossy.put_if_absent("lease/gen-000000000007", b"theirs") is False
    assert storage.get("lease/gen-000000000007") == b"mine"
    lossy.delete("objects/ab/retried")
    with pytest.raises(FileNotFoundError):
        storage.stat("objects/ab/retried")
    assert sorted(lossy.list("")) == ["lease/gen-000000000007"]
    assert lossy.inner.lost >= 6


class _LoseFirstAnswer:
    """Does each operation, then raises ``ConnectionResetError`` instead of answering, every
    other call: what a client sees when the connection drops after the server acted."""

    def __init__(self, inner: Storage) -> None:
        self.inner, self.url = inner, inner.url
        self.readinto_is_zero_copy = inner.readinto_is_zero_copy
        self.lost = 0

    def __getattr__(self, name: str) -> Callable[..., object]:
        method = getattr(self.inner, name)

        def call(*args: object) -> object:
            result = method(*args)
            if name == "list":
                result = list(result)  # type: ignore[call-overload]
            if self.lost % 2 == 0 and name != "get":
                self.lost += 1
                raise ConnectionResetError(f"{name}: connection reset after the server acted")
            self.lost += 1 if name != "get" else 0
            return result

        return call


# -- "folders" -----------------------------------------------------------------------------


def test_folder_entries_are_not_keys(backend: Backend) -> None:
    """A "folder" (a directory; a zero-byte ``prefix/`` object that consoles create) is never
    listed as a key, and is never an object."""
    storage = backend.storage
    _fill(storage, LAYOUT)
    backend.make_folder("snapshots/step-000000000005-cccccccc")
    backend.make_folder("objects/ee")
    assert sorted(storage.list("")) == sorted(LAYOUT)
    assert sorted(storage.list("snapshots/")) == sorted(LAYOUT[4:])
    assert list(storage.list("snapshots/step-000000000005-cccccccc/")) == []
    assert list(storage.list("objects/ee/")) == []
    with pytest.raises(FileNotFoundError):
        storage.stat("snapshots/step-000000000005-cccccccc")


def test_listing_after_deleting_everything_under_a_prefix(storage: Storage) -> None:
    """Some servers (SeaweedFS) keep listing ``prefix/`` once its last object is deleted; it
    must not come back as a key (a deleted snapshot would look interrupted)."""
    _fill(storage, LAYOUT)
    for key in LAYOUT[4:]:
        storage.delete(key)
    assert list(storage.list("snapshots/")) == []
    assert list(storage.list("snapshots/step-000000000003-aaaaaaaa/")) == []
    assert sorted(storage.list("")) == sorted(LAYOUT[:4])
    for key in LAYOUT[:4]:
        storage.delete(key)
    assert list(storage.list("")) == []


# -- errors ----------------------------------------------------------------------------------


def test_backend_errors_are_builtins(backend: Backend, tmp_path: Path) -> None:
    """A store that cannot do what is asked says so with an ``OSError`` (a missing key with a
    ``FileNotFoundError``), never with its client library's own exception type."""
    if backend.name == "memory":
        pytest.skip("the memory store has no failure but a missing key (tested above)")
    if backend.name == "posix":
        (tmp_path / "a-file").write_bytes(b"x")
        broken: Storage = PosixStorage(tmp_path / "a-file" / "root")
    elif backend.name == "az":  # nothing listens there: the Azure SDK fails in its own way
        from azure.storage.blob.aio import BlobServiceClient

        from trainsnap.testing.azurite import connection_string
        from trainsnap.testing.harness import free_port

        unreachable = connection_string(f"http://127.0.0.1:{free_port()}")
        az = _fsspec_of(open_storage("az://container/run", connection_string=unreachable))
        assert az is not None
        # No retries (the SDK's own back off for a minute): the first error is the one.
        az.fs.service_client = BlobServiceClient.from_connection_string(unreachable, retry_total=0)
        broken = az
    elif backend.name == "gcs":
        from trainsnap.testing.gcs import options
        from trainsnap.testing.harness import free_port

        gs = _fsspec_of(
            open_storage("gs://bucket/run", **options(f"http://127.0.0.1:{free_port()}"))
        )
        assert gs is not None
        # gcsfs retries a refused connection 6 times over 30 s; one try gives the same error.
        gs.fs._request = types.MethodType(type(gs.fs)._request.__wrapped__, gs.fs)
        broken = gs
    else:  # nothing listens there: the client library fails to connect, in its own way
        from trainsnap.testing.harness import free_port

        unreachable = f"http://127.0.0.1:{free_port()}"
        broken = open_storage(  # trainsnap turns the client's own retries off
            "s3://bucket/run", endpoint_url=unreachable, config_kwargs={"connect_timeout": 1}
        )
        broken = getattr(broken, "inner", broken)  # no retries: the first error is the one
    operations: list[Callable[[], object]] = [
        lambda: broken.put("objects/ab/x", b"x"),
        lambda: broken.put_if_absent("lease/gen-000000000001", b"x"),
        lambda: broken.get("objects/ab/x"),
        lambda: broken.stat("objects/ab/x"),
    ]
    for op in operations:
        with pytest.raises(OSError) as caught:
            op()
        error = caught.value  # a builtin, or trainsnap's own (naming the store and key)
        assert type(error).__module__ == "builtins" or isinstance(error, ts.TrainsnapError), repr(
            error
        )


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
