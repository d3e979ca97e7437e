"""The commit: what makes a snapshot exist, and the one function that decides it.

A snapshot is committed when, and only when, its marker ``snapshots/<id>/COMMITTED`` exists and
names a manifest of the size it records. The marker is written last:

1. (all ranks) every object the manifest will reference is written (content-addressed, fsynced,
   renamed) and its size checked back;
2. (coordinator) the manifest (``manifest.bin``) is written whole;
3. (coordinator) the marker -- the manifest's size and checksum -- is written whole.

A crash before step 3 leaves no marker: the snapshot does not exist for any reader, and its
objects are garbage for the collector. A crash after step 3 leaves a complete snapshot. Readers
go further than :func:`committed_marker` before trusting bytes: :func:`open_snapshot` checks the
manifest against the marker's checksum and its schema, and every block read is verified.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from trainsnap import faults
from trainsnap.errors import (
    CorruptError,
    IncompatibleError,
    IncompleteError,
    InvalidArgumentError,
    NotFoundError,
    TrainsnapError,
)
from trainsnap.format.encoding import decode, encode
from trainsnap.format.manifest import (
    Manifest,
    check_snapshot_id,
    manifest_key,
    manifest_keys,
    marker_key,
)
from trainsnap.format.marker import (
    MAX_MARKER_BYTES,
    Marker,
    check_manifest_bytes,
    decode_marker,
    encode_marker,
)
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)


def new_snapshot_id(step: int) -> str:
    """``step-<12 digits>-<8 random hex>``: sorts by step, unique across attempts and jobs."""
    if step < 0:
        raise InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
    return f"step-{step:012d}-{secrets.token_hex(4)}"


def write_commit(
    storage: Storage,
    manifest: Manifest,
    writer: Mapping[str, Any],
    fence: Callable[[], None] | None = None,
) -> bytes:
    """Steps 2 and 3 of the protocol (coordinator). Returns the manifest bytes. ``fence``
    raises if this writer may no longer commit (a newer one took the root over); it is asked
    before the manifest and again just before the marker."""
    data = encode(manifest)
    sid = manifest.snapshot_id
    if fence is not None:
        fence()
    faults.point("before_manifest")
    storage.put(manifest_key(sid), data)
    faults.point("before_marker")
    if fence is not None:
        fence()
    storage.put(marker_key(sid), encode_marker(manifest, data, writer))
    faults.point("after_marker")
    return data


class Committer(Protocol):
    """How a save commits: the seam between the save protocol (plan, write, report) and what
    makes its snapshot exist. The protocol calls, in order:

    1. :meth:`prepared` (all ranks, on the caller's thread, once the plan is agreed and the
       state staged, before anything is written);
    2. :meth:`write` (coordinator, every report in and good): the manifest and marker, built by
       ``format/``;
    3. :meth:`settle` (all ranks, once every rank knows the coordinator's outcome was good):
       the rest of the commit (a replicated commit's copies and markers); an error here is the
       save's failure, raised on every rank.

    ``reports_inline``: write reports travel through the control plane only, never through
    ``storage`` (a rank's storage is not the coordinator's, as a node directory is not)."""

    reports_inline: bool

    def prepared(self, pending: Any) -> None:
        """``pending``: the :class:`~trainsnap.protocol.save_protocol.PendingSave`; ``report``
        below: this rank's :class:`~trainsnap.protocol.rank_save.WriteReport` (this module is
        below both)."""

    def write(
        self,
        storage: Storage,
        manifest: Manifest,
        writer: Mapping[str, Any],
        fence: Callable[[], None] | None,
    ) -> None: ...

    def settle(self, pending: Any, report: Any, manifest: Manifest | None) -> None: ...


class DirectCommit:
    """The ordinary commit (module docstring): the coordinator writes the manifest, then the
    marker, into the save's storage; nothing before or after."""

    reports_inline = False

    def prepared(self, pending: Any) -> None:
        return None

    def write(
        self,
        storage: Storage,
        manifest: Manifest,
        writer: Mapping[str, Any],
        fence: Callable[[], None] | None,
    ) -> None:
        write_commit(storage, manifest, writer, fence)

    def settle(self, pending: Any, report: Any, manifest: Manifest | None) -> None:
        return None


DIRECT: Final = DirectCommit()


@dataclass(frozen=True, slots=True)
class Committed:
    snapshot_id: str
    marker: Marker

    @property
    def step(self) -> int:
        return int(self.marker.summary.get("step", -1))


def committed_marker(storage: Storage, snapshot_id: str) -> Marker:
    """The marker of a committed snapshot, or raise why it is not one.

    This is the single definition of "committed" used by listing, latest, retention, collection
    and load: a well-formed marker whose manifest exists with the recorded size.
    """
    check_snapshot_id(snapshot_id)
    try:
        if storage.stat(marker_key(snapshot_id)) > MAX_MARKER_BYTES:  # never read a huge one
            raise CorruptError(
                f"commit marker of snapshot {snapshot_id} is larger than a marker may be "
                f"({MAX_MARKER_BYTES} bytes): it is not one",
                snapshot_id=snapshot_id,
                path=marker_key(snapshot_id),
            )
        raw = storage.get(marker_key(snapshot_id))
    except FileNotFoundError:
        if not _has_files(storage, snapshot_id):
            raise NotFoundError(
                f"snapshot {snapshot_id} does not exist in {storage.url}; "
                "`trainsnap ls` lists the committed ones",
                snapshot_id=snapshot_id,
                path=storage.url,
            ) from None
        raise IncompleteError(
            f"snapshot {snapshot_id} in {storage.url} was never committed (no marker): its save "
            "was interrupted. It will never be read; the collector removes it.",
            snapshot_id=snapshot_id,
            path=marker_key(snapshot_id),
        ) from None
    marker = decode_marker(raw, snapshot_id)
    try:
        size = storage.stat(marker.manifest_key)
    except FileNotFoundError:
        raise CorruptError(
            f"snapshot {snapshot_id} has a commit marker but no manifest: it was damaged after "
            "commit",
            snapshot_id=snapshot_id,
            path=marker.manifest_key,
        ) from None
    if size != marker.manifest_size:
        raise CorruptError(
            f"manifest of snapshot {snapshot_id} is {size} bytes, its marker recorded "
            f"{marker.manifest_size}: changed or truncated after commit",
            snapshot_id=snapshot_id,
            path=marker.manifest_key,
        )
    return marker


def _has_files(storage: Storage, snapshot_id: str) -> bool:
    """Whether anything of ``snapshot_id`` is stored: a manifest (stat, which no listing lag
    hides) or any file of its directory (the write reports of a save that stopped early)."""
    if any(_exists(storage, k) for k in manifest_keys(snapshot_id)):
        return True
    return next(iter(storage.list(f"snapshots/{snapshot_id}/")), None) is not None


def _exists(storage: Storage, key: str) -> bool:
    try:
        storage.stat(key)
    except FileNotFoundError:
        return False
    return True


def open_snapshot(storage: Storage, snapshot_id: str) -> Manifest:
    """The manifest of a committed snapshot, checked against its marker and validated."""
    marker = committed_marker(storage, snapshot_id)
    try:
        data = storage.get(marker.manifest_key)
    except FileNotFoundError:
        raise CorruptError(
            f"manifest of snapshot {snapshot_id} disappeared", snapshot_id=snapshot_id
        ) from None
    check_manifest_bytes(marker, data)
    m = decode(data, snapshot_id=snapshot_id)
    if m.format_version != marker.format_version:
        raise CorruptError(
            f"snapshot {snapshot_id}: its marker says format {marker.format_version}, its "
            f"manifest format {m.format_version}",
            snapshot_id=snapshot_id,
            path=marker.manifest_key,
        )
    return m


def snapshot_ids(storage: Storage) -> set[str]:
    """Every snapshot id that has anything stored, committed or not."""
    ids = set()
    for key in storage.list("snapshots/"):
        parts = key.split("/")
        if len(parts) >= 2:
            try:
                ids.add(check_snapshot_id(parts[1]))
            except IncompatibleError:
                continue
    return ids


def list_committed(
    storage: Storage, problems: list[TrainsnapError] | None = None
) -> list[Committed]:
    """Committed snapshots, oldest first (by step, then creation time, then id).

    A snapshot whose marker exists but is damaged is left out of the list and, when
    ``problems`` is given, reported there; an uncommitted one is silently left out.
    """
    out = []
    for sid in snapshot_ids(storage):
        try:
            out.append(Committed(sid, committed_marker(storage, sid)))
        except (IncompleteError, NotFoundError):
            continue
        except TrainsnapError as e:
            if problems is None:
                log.warning("snapshot %s is not readable: %s", sid, e)
            else:
                problems.append(e)
    out.sort(key=lambda c: (c.step, str(c.marker.summary.get("created", "")), c.snapshot_id))
    return out


def resolve(storage: Storage, snapshot: str) -> str:
    """The id ``snapshot`` names: ``"latest"`` is the newest committed snapshot."""
    if snapshot != "latest":
        return snapshot
    found = list_committed(storage)
    if not found:
        raise NotFoundError(
            f"no committed snapshot in {storage.url}; save one first, or check the root",
            path=storage.url,
        )
    return found[-1].snapshot_id


def delete_snapshot(storage: Storage, snapshot_id: str) -> None:
    """Uncommit (marker first), then remove the rest of the snapshot's files. Objects stay
    until a collection finds them unreferenced."""
    storage.delete(marker_key(snapshot_id))
    faults.point("delete_uncommitted")  # the marker is gone: the snapshot is already uncommitted
    for key in list(storage.list(f"snapshots/{snapshot_id}/")):
        storage.delete(key)
    for key in manifest_keys(snapshot_id):  # a listing may lag behind the writes
        storage.delete(key)
