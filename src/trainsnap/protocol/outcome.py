"""What ranks learn at the end of a save or a load: the snapshot, or every failing rank's
error."""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field
from typing import Any

from trainsnap.errors import TrainsnapError

log = logging.getLogger("trainsnap.save")
load_log = logging.getLogger("trainsnap.load")


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
