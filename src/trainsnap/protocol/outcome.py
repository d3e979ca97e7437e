"""What ranks learn at the end of a save: the snapshot, or every failing rank's error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainsnap.errors import RankErrors, RankFailure


@dataclass(slots=True)
class Outcome:
    snapshot_id: str = ""
    manifest_summary: dict[str, Any] = field(default_factory=dict)
    rank_errors: RankErrors = field(default_factory=dict)
    """Each failing rank's :class:`~trainsnap.errors.RankFailure` (or cause, as a sentence)."""

    @property
    def ok(self) -> bool:
        return not self.rank_errors


def describe_error(error: BaseException) -> str:
    """``kind: message`` of ``error`` (with where it was raised, for an error that is not a
    ``TrainsnapError``): :attr:`RankFailure.cause <trainsnap.errors.RankFailure.cause>`."""
    return RankFailure.of(0, error).cause
