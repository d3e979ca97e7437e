"""What a user sees of a committed snapshot: :class:`SnapshotInfo`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from trainsnap.format.manifest import Manifest
from trainsnap.format.marker import Marker
from trainsnap.state.load_target import Component


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """A committed snapshot, as listed, saved or loaded.

    ``level`` is what the snapshot offers when listed or saved, and what was reached when
    returned by a load. ``nbytes`` is the bytes its objects occupy. ``reasons`` says, for a
    load that reached less than ``strict``, why not higher; ``sources``, for a restore from the
    memory tier, where its bytes came from; ``components``, for a load, each component of the
    state (``model``, ``optimizer``, ``scheduler``, ``scaler``, ``extra``, ``grads``, ``data``,
    ``rng.python``, ``rng.numpy``, ``rng.torch``, ``rng.cuda``; a plain state's top-level keys)
    restored or not and why.
    """

    id: str
    step: int
    created: datetime
    level: str
    nbytes: int
    root: str
    tokens_seen: int | None = None
    reasons: tuple[str, ...] = ()
    sources: Mapping[str, int] = field(default_factory=dict)
    """For a restore from the memory tier: bytes this rank got from each place ("memory (this
    node)", "memory (partner node)"); empty otherwise (the bytes came from ``root``)."""
    components: tuple[Component, ...] = ()
    """For a load: each component of the state, restored or not, and why not (empty when
    listed or saved)."""

    def restore_record(self) -> list[dict[str, Any]]:
        """``components`` as plain data, for the restart log."""
        return [c.as_dict() for c in self.components]

    @staticmethod
    def from_manifest(
        manifest: Manifest,
        root: str,
        level: str | None = None,
        reasons: tuple[str, ...] = (),
        components: tuple[Component, ...] = (),
    ) -> SnapshotInfo:
        return SnapshotInfo(
            id=manifest.snapshot_id,
            step=manifest.step,
            created=_parse_time(manifest.created),
            level=level or manifest.level,
            nbytes=manifest.nbytes,
            root=root,
            tokens_seen=manifest.tokens_seen,
            reasons=reasons,
            components=components,
        )

    @staticmethod
    def from_marker(marker: Marker, root: str) -> SnapshotInfo:
        return SnapshotInfo.from_summary(marker.snapshot_id, marker.summary, root)

    @staticmethod
    def from_summary(snapshot_id: str, summary: Mapping[str, Any], root: str) -> SnapshotInfo:
        return SnapshotInfo(
            id=snapshot_id,
            step=int(summary.get("step", -1)),
            created=_parse_time(str(summary.get("created", ""))),
            level=str(summary.get("level", "weights")),
            nbytes=int(summary.get("nbytes", 0)),
            root=root,
            tokens_seen=summary.get("tokens_seen"),
        )


def _parse_time(text: str) -> datetime:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return datetime.fromtimestamp(0).astimezone()
