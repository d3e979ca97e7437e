"""Verification: re-read every byte a snapshot references and check it against the manifest.

For each snapshot: the marker is well formed and matches the manifest (size, checksum and the
summary it repeats); the manifest is valid; the shards of every tensor tile it exactly; every
object exists with its recorded size, every block matches its digest and the object's name is the
digest of its content; every value's chunks lie, without overlapping, in objects that hold them,
and every JSON value decodes. Findings are gathered, not raised one by one: the report lists
every problem, and :func:`verify` raises the matching error kind with all of them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from trainsnap import tunables
from trainsnap.engine.pool import run_all
from trainsnap.errors import (
    CorruptError,
    IncompatibleError,
    IncompleteError,
    NotFoundError,
    TrainsnapError,
    listed,
)
from trainsnap.format import compression
from trainsnap.format.manifest import Manifest, object_key
from trainsnap.format.regions import tiling_problems
from trainsnap.protocol import commit
from trainsnap.storage import Storage, open_storage
from trainsnap.storage.base import NotRegularFileError

Progress = Callable[[int], None]
"""Called with the size of each object once it is verified (from I/O threads, one at a time)."""

_SEVERITY: list[type[TrainsnapError]] = [
    CorruptError,
    IncompleteError,
    IncompatibleError,
    NotFoundError,
]


@dataclass(slots=True)
class Problem:
    kind: type[TrainsnapError]
    snapshot_id: str
    message: str
    path: str | None = None

    def __str__(self) -> str:
        where = f" [{self.path}]" if self.path else ""
        return f"{self.snapshot_id}: {self.message}{where}"


@dataclass(slots=True)
class SnapshotReport:
    id: str
    step: int = -1
    objects: int = 0
    nbytes: int = 0
    bytes_read: int = 0
    """Bytes of objects read for this snapshot (objects shared with one verified before are
    read once)."""
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(slots=True)
class VerifyReport:
    root: str
    snapshots: list[SnapshotReport] = field(default_factory=list)
    uncommitted: list[str] = field(default_factory=list)
    """Snapshots with no marker: never readable, garbage for the collector (not a problem)."""
    bytes_verified: int = 0
    """Bytes read and checked, each shared object counted once."""
    seconds: float = 0.0

    @property
    def problems(self) -> list[Problem]:
        return [p for s in self.snapshots for p in s.problems]

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_problems(self) -> None:
        probs = self.problems
        if not probs:
            return
        kind = next(k for k in _SEVERITY if any(p.kind is k for p in probs))
        bad = sorted({p.snapshot_id for p in probs})
        raise kind(
            f"verification of {self.root} found {len(probs)} problem(s) in snapshot(s) "
            f"{listed(bad)}. Do not resume from them; restore an older snapshot.",
            snapshot_id=bad[0],
            path=probs[0].path,
            problems=[str(p) for p in probs],
            see_all=f"`trainsnap verify {self.root}` lists every one",
        )


def _check_object(storage: Storage, manifest: Manifest, obj: int) -> list[Problem]:
    name = manifest.object_names[obj]
    key = object_key(name)
    size = int(manifest.stored()[obj])
    sid = manifest.snapshot_id
    try:
        stored = storage.stat(key)
    except NotRegularFileError as e:
        why = f"object {name} is not a regular file of the root ({e.strerror})"
        return [Problem(CorruptError, sid, why, key)]
    except FileNotFoundError:
        return [Problem(CorruptError, sid, f"object {name} is missing", key)]
    except OSError as e:
        return [Problem(CorruptError, sid, f"object {name} cannot be read: {e}", key)]
    if stored != size:
        what = "truncated" if stored < size else "longer than recorded"
        return [
            Problem(CorruptError, sid, f"object {name} is {what}: {stored} of {size} bytes", key)
        ]
    if manifest.compressed(obj):
        return _check_compressed(storage, manifest, obj, key)
    h = manifest.hasher
    expected = manifest.object_blocks(obj)
    step = max(h.block_size, (16 << 20) // h.block_size * h.block_size)
    buf = memoryview(bytearray(min(step, size)))
    digests = []
    bad_blocks = []
    for pos in range(0, size, step):
        n = min(step, size - pos)
        try:
            storage.read_into(key, pos, buf[:n])
        except OSError as e:
            return [Problem(CorruptError, sid, f"object {name} cannot be read: {e}", key)]
        for i in range(0, n, h.block_size):
            d = h.digest(buf[i : min(i + h.block_size, n)])
            b = (pos + i) // h.block_size
            if d != expected[b * h.digest_size : (b + 1) * h.digest_size]:
                bad_blocks.append(b)
            digests.append(d)
    out = []
    if bad_blocks:
        shown = ", ".join(map(str, bad_blocks[:8])) + (" ..." if len(bad_blocks) > 8 else "")
        out.append(
            Problem(CorruptError, sid, f"object {name}: block(s) {shown} fail their checksum", key)
        )
    elif h.object_name(size, b"".join(digests)) != name:
        out.append(
            Problem(CorruptError, sid, f"object {name}: name does not match its content", key)
        )
    return out


def _check_compressed(storage: Storage, manifest: Manifest, obj: int, key: str) -> list[Problem]:
    """Every frame against its stored digest, every block decoded against its data digest."""
    name, sid, h = manifest.object_names[obj], manifest.snapshot_id, manifest.hasher
    try:
        stored = storage.get(key)
    except OSError as e:
        return [Problem(CorruptError, sid, f"object {name} cannot be read: {e}", key)]
    d, bs, size = h.digest_size, manifest.block_size, int(manifest.object_sizes[obj])
    expected, raw_expected = manifest.object_blocks(obj), manifest.object_raw_blocks(obj)
    bad, digests, pos = [], [], 0
    for b, n in enumerate(manifest.object_frames(obj).tolist()):
        frame = stored[pos : pos + n]
        pos += n
        digest = h.digest(frame)
        digests.append(digest)
        if digest != expected[b * d : (b + 1) * d]:
            bad.append(f"frame {b}")
            continue
        try:
            block = compression.decompress_block(
                frame, manifest.object_codecs[obj], min(bs, size - b * bs)
            )
        except ValueError:
            bad.append(f"frame {b} (does not decode)")
            continue
        if h.digest(block) != raw_expected[b * d : (b + 1) * d]:
            bad.append(f"block {b} (decoded)")
    if bad:
        shown = ", ".join(bad[:8]) + (" ..." if len(bad) > 8 else "")
        return [Problem(CorruptError, sid, f"object {name}: {shown} fail their checksum", key)]
    if h.object_name(len(stored), b"".join(digests)) != name:
        return [Problem(CorruptError, sid, f"object {name}: name does not match its content", key)]
    return []


def _check_manifest(manifest: Manifest, marker_summary: dict[str, Any]) -> list[Problem]:
    sid = manifest.snapshot_id
    out = []
    for k, v in manifest.summary().items():
        if k in marker_summary and marker_summary[k] != v:
            out.append(
                Problem(CorruptError, sid, f"marker says {k}={marker_summary[k]!r}, manifest {v!r}")
            )
    for t, shape in enumerate(manifest.tensor_shapes):
        regions = [r for _, r in manifest.tensor_shards(t)]
        for why in tiling_problems(regions, shape):
            out.append(Problem(CorruptError, sid, f"tensor {manifest.tensor_keys[t]!r}: {why}"))
    return out


def _check_values(storage: Storage, manifest: Manifest) -> list[Problem]:
    from trainsnap.engine.read_executor import read_payload
    from trainsnap.engine.reader import Reader

    reader = Reader(storage, manifest)
    out = []
    base = manifest.value_chunk_base()
    for vi, key in enumerate(manifest.value_keys):
        try:
            # Every object passed its own check (this runs only then), but a value's chunks
            # may still overlap or overrun them: a load refuses such a value, so must this.
            n = reader.checked_payload_size(base + vi, key)
            if manifest.value_codecs[vi] != "json":
                continue
            buf = bytearray(n)
            read_payload(reader, base + vi, 0, n, memoryview(buf), key)
            json.loads(bytes(buf))
        except TrainsnapError as e:
            out.append(Problem(type(e), manifest.snapshot_id, e.message, e.path))
        except (ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else e
            out.append(
                Problem(
                    CorruptError, manifest.snapshot_id, f"value {key!r} is not valid JSON: {why}"
                )
            )
    return out


def verify_snapshot(
    storage: Storage, snapshot_id: str, seen: set[str], progress: Progress | None = None
) -> SnapshotReport:
    rep = SnapshotReport(snapshot_id)
    try:
        marker = commit.committed_marker(storage, snapshot_id)
        m = commit.open_snapshot(storage, snapshot_id)
    except TrainsnapError as e:
        rep.problems.append(Problem(type(e), snapshot_id, e.message, e.path))
        return rep
    rep.step, rep.objects, rep.nbytes = m.step, len(m.object_names), m.nbytes
    rep.problems += _check_manifest(m, dict(marker.summary))
    todo = [o for o in range(len(m.object_names)) if m.object_names[o] not in seen]
    seen.update(m.object_names)
    rep.bytes_read = sum(int(m.object_sizes[o]) for o in todo)
    lock = threading.Lock()

    def task(obj: int) -> list[Problem]:
        found = _check_object(storage, m, obj)
        if progress:
            with lock:
                progress(int(m.object_sizes[obj]))
        return found

    for found in run_all([partial(task, o) for o in todo], tunables.get().io_threads):
        rep.problems += found
    if rep.ok:
        rep.problems += _check_values(storage, m)
    return rep


def verify_root(
    root: str | Storage,
    snapshot_id: str | None = None,
    progress: Progress | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Verify one snapshot, or every snapshot of the root; never raises for what it finds."""
    t0 = time.perf_counter()
    storage = open_storage(root, **dict(storage_options or {}))
    report = VerifyReport(storage.url)
    if snapshot_id is not None:
        ids = [snapshot_id]
    else:
        all_ids = commit.snapshot_ids(storage)
        found = commit.list_committed(storage)
        committed = {c.snapshot_id for c in found}
        damaged = []
        for sid in sorted(all_ids - committed):
            try:
                commit.committed_marker(storage, sid)
            except IncompleteError:
                report.uncommitted.append(sid)
                continue
            except TrainsnapError:
                damaged.append(sid)
        ids = [c.snapshot_id for c in found] + damaged
        if not ids:
            raise NotFoundError(
                f"no committed snapshot in {storage.url} to verify", path=storage.url
            )
    seen: set[str] = set()
    for sid in ids:
        rep = verify_snapshot(storage, sid, seen, progress)
        report.snapshots.append(rep)
        report.bytes_verified += rep.bytes_read
    report.seconds = time.perf_counter() - t0
    return report


def verify(
    root: str | Storage,
    snapshot_id: str | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Verify and return the report when all is well; raise the matching
    :class:`~trainsnap.TrainsnapError` kind, listing every problem, otherwise.
    ``storage_options`` go to the store as for :func:`~trainsnap.save`."""
    report = verify_root(root, snapshot_id, storage_options=storage_options)
    report.raise_if_problems()
    return report
