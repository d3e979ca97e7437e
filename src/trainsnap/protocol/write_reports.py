"""Write reports through storage: how a rank's report reaches the coordinator without the bulk
going through the control plane.

A rank's write report (:class:`~trainsnap.protocol.rank_save.WriteReport`: the objects it wrote
with their block digests, and the chunks of each payload) grows with the data it writes -- one
digest per block -- while the rendezvous store that carries the control plane is one server for
the whole job. So, in step 4 of the save protocol (:mod:`trainsnap.protocol.save_protocol`):

1. (all ranks but the coordinator) encode the report (:func:`encode`: a JSON header and the
   digests as raw bytes, never pickle). One of at most ``report_inline_max`` bytes, or one that
   says why the rank failed, is sent through the control plane as it is; a larger one is written
   to ``snapshots/<id>/reports/<rank>`` (:func:`report_key`) and only its size and digest
   (:class:`StoredReport`) are sent.
2. (coordinator) read the stored reports it was told about, in parallel on the I/O pool, and
   check each one's size and digest against what its rank sent: a report missing, truncated or
   changed is that rank's failure (no commit, the rank named), exactly as if it had sent an error.
3. (coordinator) once the outcome is broadcast, delete the reports (:func:`discard`). One left
   behind by a crash is scratch of the snapshot's directory that no reader looks at: the collector
   removes it with the uncommitted snapshot, or from a committed one once past its grace period.

The report files are not part of the committed format: readers ignore them (FORMAT.md §1), and
the coordinator reads only the keys it derives from its own, freshly drawn snapshot id.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

from trainsnap import tunables
from trainsnap.engine.pool import run_all
from trainsnap.errors import CorruptError
from trainsnap.format.manifest import StoredObject
from trainsnap.protocol.rank_save import WriteReport, Written
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)

MAGIC: Final = b"\x89TSRPT1\n"
_HEAD: Final = struct.Struct("<8sQ")  # magic, header length
DIGEST_SIZE: Final = 16


def report_key(snapshot_id: str, rank: int) -> str:
    """Where rank ``rank`` stores its write report for snapshot ``snapshot_id``."""
    return f"snapshots/{snapshot_id}/reports/{rank}"


def reports_prefix(snapshot_id: str) -> str:
    return f"snapshots/{snapshot_id}/reports/"


def digest(data: bytes) -> bytes:
    """BLAKE2b-128 of a stored report: a cryptographic hash, so that the bytes the coordinator
    decodes are the ones its rank wrote, whatever else can write to the root."""
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


@dataclass(frozen=True, slots=True)
class StoredReport:
    """What the control plane carries for a report written to storage (the key is derived from
    the snapshot id and the sending rank, never taken from the message)."""

    size: int
    digest: bytes


# -- encoding -------------------------------------------------------------------------------------


def encode(report: WriteReport) -> bytes:
    """A JSON header (everything but the digests) followed by the objects' digests, raw."""
    body: list[bytes] = []
    objects = []
    for name, size, digests, codec, stored, frames, decoded in report.objects:
        on_storage = size if stored is None else stored
        objects.append([name, size, codec, on_storage, list(frames), len(digests), len(decoded)])
        body += [digests, decoded]
    header = {
        "objects": objects,
        "entries": [[i, scope, [list(c) for c in chunks]] for i, scope, chunks in report.entries],
        "values": [[i, scope, [list(c) for c in chunks]] for i, scope, chunks in report.values],
        "bytes_new": report.bytes_new,
        "error": report.error,
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([_HEAD.pack(MAGIC, len(text)), text, *body])


def decode(data: bytes) -> WriteReport:
    """The report :func:`encode` made; ``CorruptError`` for anything else. O(len(data)): every
    count and length in it is checked against the bytes that are there before it is used."""
    try:
        magic, length = _HEAD.unpack_from(data)
        if magic != MAGIC or _HEAD.size + length > len(data):
            raise ValueError("not a write report")
        header = json.loads(data[_HEAD.size : _HEAD.size + length])
        at = _HEAD.size + length
        report = WriteReport(bytes_new=_int(header["bytes_new"]), error=header["error"])
        if report.error is not None and not isinstance(report.error, str):
            raise ValueError("error is not a string")
        for name, size, codec, stored, frames, n, m in header["objects"]:
            digests, decoded = data[at : at + _int(n)], data[at + n : at + n + _int(m)]
            at += n + m
            if len(digests) != n or len(decoded) != m:
                raise ValueError("digests past the end")
            if not (isinstance(name, str) and isinstance(codec, str)):
                raise ValueError("object name or codec is not a string")
            sizes = (_int(size), digests, codec, _int(stored), _ints(frames))
            report.objects.append(StoredObject(name, *sizes, decoded))
        if at != len(data):
            raise ValueError("bytes after the digests")
        report.entries = [_written(item) for item in header["entries"]]
        report.values = [_written(item) for item in header["values"]]
    except RecursionError:
        raise CorruptError("a write report that cannot be decoded: nested too deeply") from None
    except (ValueError, TypeError, KeyError, struct.error) as e:
        raise CorruptError(f"a write report that cannot be decoded: {str(e)[:200]}") from None
    return report


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(_int(v) for v in values)


def _written(item: Any) -> Written:
    index, scope, chunks = item
    if isinstance(scope, bool) or not isinstance(scope, int):
        raise ValueError(f"scope {scope!r} is not an integer")
    return Written(_int(index), scope, [(_int(o), _int(off), _int(n)) for o, off, n in chunks])


# -- sending and receiving ------------------------------------------------------------------------


def outgoing(
    storage: Storage, snapshot_id: str, rank: int, report: WriteReport, *, inline: bool = False
) -> Any:
    """Step 1 (a rank other than the coordinator): what it sends the coordinator -- its encoded
    report, or where it stored it; always the report itself with ``inline`` (a save whose
    ranks do not share its storage: a memory tier's node directories). A report that cannot be
    stored becomes the rank's error."""
    data = encode(report)
    if inline or report.error is not None or len(data) <= tunables.get().report_inline_max:
        return data
    key = report_key(snapshot_id, rank)
    try:
        storage.put(key, data)
    except Exception as e:
        why = f"could not store its write report ({len(data)} bytes) at {key}: {e!r}"
        return encode(WriteReport(error=why))
    return StoredReport(len(data), digest(data))


def incoming(
    storage: Storage, snapshot_id: str, messages: list[Any], own: int, own_report: WriteReport
) -> tuple[list[WriteReport], list[str]]:
    """Step 2 (coordinator): every rank's report, by rank, from what each one sent (the
    coordinator's own ``own_report`` as it is); a report that could not be had is an error
    report of its rank. Also the keys of the reports read from storage (for :func:`discard`)."""
    reports: dict[int, WriteReport] = {}
    stored: list[int] = []
    for rank, message in enumerate(messages):
        if rank == own:
            reports[rank] = own_report
        elif isinstance(message, StoredReport):
            stored.append(rank)
        else:
            reports[rank] = _inline(message)
    tasks = [partial(_read, storage, snapshot_id, r, messages[r]) for r in stored]
    reports.update(zip(stored, run_all(tasks, tunables.get().io_threads), strict=True))
    ordered = [reports[rank] for rank in range(len(messages))]
    return ordered, [report_key(snapshot_id, r) for r in stored]


def _inline(message: Any) -> WriteReport:
    if not isinstance(message, bytes):
        return WriteReport(error=f"sent a write report of unknown kind {type(message).__name__}")
    try:
        return decode(message)
    except CorruptError as e:
        return WriteReport(error=f"sent a write report that cannot be read: {e.message}")


def _read(storage: Storage, snapshot_id: str, rank: int, sent: StoredReport) -> WriteReport:
    """One stored report, checked against what its rank sent; never raises (a failure is the
    rank's error report)."""
    key = report_key(snapshot_id, rank)
    try:
        stored = storage.stat(key)
        if stored != sent.size:  # before reading: never read more than the rank wrote
            return WriteReport(
                error=f"its write report {key} is {stored} bytes, but the rank sent "
                f"{sent.size}: the stored report was changed or truncated"
            )
        data = storage.get(key)
    except FileNotFoundError:
        return WriteReport(
            error=f"its write report {key} is missing from storage: it was deleted or lost "
            "after the rank stored it"
        )
    except Exception as e:
        return WriteReport(error=f"its write report {key} could not be read: {e!r}")
    if len(data) != sent.size or digest(data) != sent.digest:
        return WriteReport(
            error=f"its write report {key} is {len(data)} bytes with digest "
            f"{digest(data).hex()}, but the rank sent {sent.size} bytes with digest "
            f"{sent.digest.hex()}: the stored report was changed or truncated"
        )
    try:
        return decode(data)
    except CorruptError as e:
        return WriteReport(error=f"its write report {key} cannot be read: {e.message}")


def discard(storage: Storage, snapshot_id: str, keys: list[str], *, committed: bool) -> None:
    """Step 3 (coordinator): delete the reports once the outcome is known. After a failure the
    snapshot's reports are listed too: a rank may have stored one the coordinator never heard
    of. Best effort: what is left is garbage for the collector."""
    try:
        if not committed:
            keys = sorted({*keys, *storage.list(reports_prefix(snapshot_id))})
        run_all([partial(storage.delete, k) for k in keys], tunables.get().io_threads)
    except Exception:
        log.warning(
            "could not delete the write reports of snapshot %s; the collector will",
            snapshot_id,
            exc_info=True,
        )
