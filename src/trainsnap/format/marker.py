"""The commit marker: the small document whose existence commits a snapshot.

Pure: no I/O. It records the manifest's size and checksum (so a reader can tell the manifest it
finds is the one committed) and repeats a few manifest fields for cheap listing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Final

from trainsnap.errors import CorruptError, IncompatibleError, TrainsnapError
from trainsnap.format.checksums import Hasher
from trainsnap.format.encoding import MAX_MANIFEST, as_dict
from trainsnap.format.manifest import (
    FORMAT_VERSION,
    LEVELS,
    MARKER_FORMAT,
    READABLE_VERSIONS,
    Manifest,
    check_snapshot_id,
    id_step,
    manifest_key,
)
from trainsnap.format.validation import LIMIT


@dataclass(frozen=True, slots=True)
class Marker:
    snapshot_id: str
    manifest_size: int
    manifest_digest: str
    algorithm: str
    summary: Mapping[str, Any]
    writer: Mapping[str, Any]
    format_version: int = FORMAT_VERSION
    """The snapshot's format version: it names the manifest's key."""

    @property
    def manifest_key(self) -> str:
        return manifest_key(self.snapshot_id, self.format_version)


def encode_marker(manifest: Manifest, manifest_bytes: bytes, writer: Mapping[str, Any]) -> bytes:
    doc = {
        "format": MARKER_FORMAT,
        "format_version": FORMAT_VERSION,
        "snapshot_id": manifest.snapshot_id,
        "manifest": {
            "size": len(manifest_bytes),
            "algorithm": manifest.algorithm,
            "digest": manifest.hasher.digest(manifest_bytes).hex(),
        },
        "summary": manifest.summary(),
        "writer": dict(writer),
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def with_writer(data: bytes, snapshot_id: str, writer: Mapping[str, Any]) -> bytes:
    """The marker ``data`` (checked as :func:`decode_marker` does) with its ``writer`` record
    replaced: a snapshot copied to another root (a promotion) commits there with the same
    manifest and summary, and says who wrote it there."""
    decode_marker(data, snapshot_id)
    doc = json.loads(data)
    doc["writer"] = dict(writer)
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


MAX_MARKER_BYTES: Final = 1 << 20
"""A marker is a few hundred bytes; one larger than this is refused before it is parsed."""


def _reason(error: Exception) -> str:
    return "nested too deeply" if isinstance(error, RecursionError) else str(error)


def decode_marker(data: bytes, snapshot_id: str) -> Marker:
    if len(data) > MAX_MARKER_BYTES:
        raise CorruptError(
            f"commit marker of snapshot {snapshot_id} is {len(data)} bytes, more than a marker "
            f"may be ({MAX_MARKER_BYTES}): it is not one",
            snapshot_id=snapshot_id,
        )
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT:
            raise ValueError("not a trainsnap marker")
        if doc.get("format_version") not in READABLE_VERSIONS:
            raise IncompatibleError(
                f"snapshot {snapshot_id} has marker format version "
                f"{doc.get('format_version')!r}; this trainsnap reads {list(READABLE_VERSIONS)}. "
                "Upgrade trainsnap.",
                snapshot_id=snapshot_id,
            )
        man = as_dict(doc["manifest"], "manifest")
        size = man["size"]
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_MANIFEST:
            raise ValueError(f"manifest.size: expected an integer in [0, {MAX_MANIFEST}]")
        digest, algorithm = man["digest"], man["algorithm"]
        if not isinstance(digest, str) or not isinstance(algorithm, str):
            raise ValueError("manifest.digest and manifest.algorithm must be strings")
        Hasher(algorithm)
        summary = _check_summary(as_dict(doc["summary"], "summary"), snapshot_id)
        marker = Marker(
            snapshot_id=check_snapshot_id(doc["snapshot_id"]),
            manifest_size=size,
            manifest_digest=digest,
            algorithm=algorithm,
            summary=summary,
            writer=as_dict(doc.get("writer", {}), "writer"),
            format_version=doc["format_version"],
        )
    except TrainsnapError:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptError(
            f"commit marker of snapshot {snapshot_id} is malformed: {_reason(e)}",
            snapshot_id=snapshot_id,
        ) from e
    if marker.snapshot_id != snapshot_id:
        raise CorruptError(
            f"commit marker under snapshot {snapshot_id} names {marker.snapshot_id!r}",
            snapshot_id=snapshot_id,
        )
    return marker


def _check_summary(shard: dict[str, Any], snapshot_id: str) -> dict[str, Any]:
    """The marker repeats a few manifest fields for cheap listing; they must be well typed and
    agree with the id (a verifier also checks them against the manifest)."""
    step, nbytes, tokens = shard.get("step"), shard.get("nbytes"), shard.get("tokens_seen")
    for name, v in (("step", step), ("nbytes", nbytes)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < LIMIT:
            raise ValueError(f"summary.{name}: expected an integer in [0, 2^62), got {v!r}")
    if tokens is not None and (
        isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens < LIMIT
    ):
        raise ValueError("summary.tokens_seen: expected an integer in [0, 2^62) or null")
    _check_created(shard.get("created"))
    if shard.get("level") not in LEVELS:
        raise ValueError(f"summary.level: expected one of {LEVELS}, got {shard.get('level')!r}")
    metrics = shard.get("metrics", {})
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str)
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and abs(v) < 1e300
        for k, v in metrics.items()
    ):
        raise ValueError("summary.metrics: expected an object of numbers")
    tags = shard.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError("summary.tags: expected a list of strings")
    if step != id_step(snapshot_id):
        raise ValueError(f"summary.step {step} disagrees with the snapshot id {snapshot_id}")
    return shard


def _check_created(created: object) -> None:
    """An ISO time a listing can render: with an offset, in the years 1970-9999."""
    if not isinstance(created, str) or len(created) > 64:
        raise ValueError("summary.created: expected an ISO time string")
    try:
        moment = datetime.fromisoformat(created.replace("Z", "+00:00"))
        moment.astimezone(timezone.utc)
    except (ValueError, OverflowError) as e:
        raise ValueError(f"summary.created: {created!r} is not a usable ISO time ({e})") from e
    if not 1970 <= moment.year <= 9999:
        raise ValueError(f"summary.created: year {moment.year} outside 1970-9999")


def check_manifest_bytes(marker: Marker, data: bytes) -> None:
    """Raise :class:`CorruptError` unless ``data`` is the manifest the marker committed."""
    if len(data) != marker.manifest_size:
        raise CorruptError(
            f"manifest of snapshot {marker.snapshot_id} is {len(data)} bytes, the commit marker "
            f"recorded {marker.manifest_size}: it was changed or truncated after commit",
            snapshot_id=marker.snapshot_id,
            path=marker.manifest_key,
        )
    digest = Hasher(marker.algorithm).digest(data).hex()
    if digest != marker.manifest_digest:
        raise CorruptError(
            f"manifest of snapshot {marker.snapshot_id} does not match the checksum its commit "
            "marker recorded: it was changed after commit",
            snapshot_id=marker.snapshot_id,
            path=marker.manifest_key,
        )
