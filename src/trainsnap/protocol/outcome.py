"""What ranks learn at the end of a save or a load: the snapshot, or every failing rank's
error."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

from trainsnap import errors
from trainsnap.errors import TrainsnapError


@dataclass(slots=True)
class Outcome:
    snapshot_id: str = ""
    manifest_summary: dict[str, Any] = field(default_factory=dict)
    rank_errors: dict[int, str] = field(default_factory=dict)
    kind: str = "CommitFailedError"

    @property
    def ok(self) -> bool:
        return not self.rank_errors


def describe_error(error: BaseException) -> str:
    if isinstance(error, TrainsnapError):
        return f"{type(error).__name__}: {error}"
    tb = traceback.extract_tb(error.__traceback__)
    where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
    return f"{type(error).__name__}: {error}{where}"


def told(decision: Any, error: TrainsnapError | None) -> Any:
    """What a coordinator broadcasts: its decision, or (kind, message) of its failure."""
    return decision if error is None else (type(error).__name__, str(error))


def decided(decision: Any, error: TrainsnapError | None, coordinator: int) -> Any:
    """The coordinator's broadcast ``decision``; a failure is raised: the coordinator's own
    ``error`` there, the same kind of error on the other ranks."""
    if error is not None:
        raise error
    if isinstance(decision, tuple) and len(decision) == 2 and isinstance(decision[0], str):
        kind, message = decision
        cls = getattr(errors, kind, TrainsnapError)
        if not (isinstance(cls, type) and issubclass(cls, TrainsnapError)):
            cls = TrainsnapError
        raise cls(f"{message} (found by the coordinator, rank {coordinator})")
    return decision
