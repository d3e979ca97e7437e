"""The errors trainsnap raises on purpose.

Every error is a :class:`TrainsnapError`; the subclasses say what kind of thing went wrong so that
callers (and the manager's fallback logic) can react to the kind rather than parse messages. Each
carries what is known of where it happened -- snapshot id, key, rank, path -- as attributes, and
its message says what failed, the likely cause and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

MAX_LISTED = 20
"""Items an error message spells out (problems, keys, snapshot ids); the rest are counted."""

__all__ = [
    "CommitFailedError",
    "CorruptError",
    "IncompatibleError",
    "IncompleteError",
    "InvalidArgumentError",
    "LoadFailedError",
    "NotFoundError",
    "RankFailure",
    "TrainsnapError",
]


def bounded(items: Iterable[str], *, see_all: str = "", limit: int = MAX_LISTED) -> list[str]:
    """The first ``limit`` of ``items``, then, when there are more, one line counting the rest
    and saying where to see them all (``see_all``, e.g. "`trainsnap show ROOT` lists every
    key"). A message stays readable however many keys a state has. O(len(items))."""
    shown: list[str] = []
    total = 0
    for item in items:
        if total < limit:
            shown.append(item)
        total += 1
    if total > limit:
        where = f"; {see_all}" if see_all else ""
        shown.append(f"... and {total - limit} more ({total} in all{where})")
    return shown


def listed(items: Iterable[str], *, see_all: str = "", limit: int = MAX_LISTED) -> str:
    """:func:`bounded` as one comma-separated phrase, for a list inside a sentence."""
    return ", ".join(bounded(items, see_all=see_all, limit=limit))


class TrainsnapError(Exception):
    """Base of every error trainsnap raises on purpose.

    Attributes:
        snapshot_id: the snapshot concerned, when known.
        key: the state key (``model.layers.0.weight``) or storage key concerned, when known.
        path: the storage path or URL concerned, when known.
        rank: the rank on which it happened, when known.
        problems: for errors that gather several findings (verification, a collective failure),
            each finding as one line: all of them, while the message shows the first
            :data:`MAX_LISTED` and counts the rest.
        see_all: where the user can see everything when the message lists only part (a
            command, or the attribute).
    """

    def __init__(
        self,
        message: str,
        *,
        snapshot_id: str | None = None,
        key: str | None = None,
        path: str | None = None,
        rank: int | None = None,
        problems: Sequence[str] = (),
        see_all: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.snapshot_id = snapshot_id
        self.key = key
        self.path = path
        self.rank = rank
        self.problems = list(problems)
        self.see_all = see_all or "every one is in the error's `problems` attribute"

    def __str__(self) -> str:
        if not self.problems:
            return self.message
        lines = [self.message, *(f"  - {p}" for p in bounded(self.problems, see_all=self.see_all))]
        return "\n".join(lines)


class NotFoundError(TrainsnapError):
    """A snapshot, root or key that was asked for does not exist."""


class IncompleteError(TrainsnapError):
    """A snapshot exists but was never committed (no marker): it must not be read."""


class CorruptError(TrainsnapError):
    """Stored bytes do not match what the manifest or marker recorded (checksum, size, presence)."""


class IncompatibleError(TrainsnapError):
    """A snapshot cannot be used as asked: unknown format version, schema violation, a shape or
    dtype that differs from the state, a resume level it cannot give, or content (pickle) that
    needs an explicit opt-in."""


@dataclass(frozen=True, slots=True)
class RankFailure:
    """One rank's failure in a step of several ranks, as every rank learns it: a record, not a
    sentence, so that a rank can tell a lost peer from a corrupt object without parsing.

    Attributes:
        rank: the rank that failed.
        kind: the class name of its error (``OSError``, ``CorruptError``, ``PeerLost``, ...);
            empty for a cause known only as a sentence.
        message: the error's message (for an error that is not a :class:`TrainsnapError`,
            with the file and line it was raised at).
        where: the step it failed in (``session/tag``, e.g. ``save/report``); empty when not
            known.
    """

    rank: int
    kind: str
    message: str
    where: str = ""

    @classmethod
    def of(cls, rank: int, error: BaseException, where: str = "") -> RankFailure:
        """The record of ``error`` raised on ``rank`` in step ``where``."""
        message = str(error)
        if not isinstance(error, TrainsnapError):
            tb = error.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            if tb is not None:
                name = tb.tb_frame.f_code.co_filename.rsplit("/", 1)[-1]
                message = f"{message} (at {name}:{tb.tb_lineno})"
        return cls(rank, type(error).__name__, message, where)

    @property
    def cause(self) -> str:
        """``kind: message`` (the message alone when the kind is not known)."""
        return f"{self.kind}: {self.message}" if self.kind else self.message

    def __str__(self) -> str:
        where = f" (in {self.where})" if self.where else ""
        return f"rank {self.rank}: {self.cause}{where}"


RankErrors = Mapping[int, str | RankFailure]
"""Each failing rank and its cause: a :class:`RankFailure`, or a sentence."""


class _RankErrors(TrainsnapError):
    """A step of several ranks that failed: each failing rank and its cause.

    Attributes:
        failures: each failing rank's :class:`RankFailure` (one line each in ``problems`` too).
        rank_errors: each failing rank's cause as a sentence (``kind: message``).
    """

    def __init__(
        self,
        message: str,
        *,
        rank_errors: RankErrors | None = None,
        snapshot_id: str | None = None,
        key: str | None = None,
        path: str | None = None,
        rank: int | None = None,
        problems: Sequence[str] = (),
        see_all: str = "",
    ) -> None:
        failures = {
            r: e if isinstance(e, RankFailure) else RankFailure(r, "", str(e))
            for r, e in (rank_errors or {}).items()
        }
        lines = list(problems) or [str(f) for _, f in sorted(failures.items())]
        super().__init__(
            message,
            snapshot_id=snapshot_id,
            key=key,
            path=path,
            rank=rank,
            problems=lines,
            see_all=see_all,
        )
        self.failures = failures
        self.rank_errors = {r: f.cause for r, f in failures.items()}


class CommitFailedError(_RankErrors):
    """A save did not commit. Nothing of it will ever be listed or read.

    Attributes:
        rank_errors: for a multi-rank save, each failing rank and its cause.
    """


class LoadFailedError(_RankErrors):
    """A load failed on some rank (or a rank was lost during it), so it failed on every rank.
    The tensors it was reading into are partly filled: load again before using the state.

    Attributes:
        rank_errors: each failing rank and its cause; the failing rank itself raises its own
            error (corrupt, incompatible, ...), the others this one.
    """


class InvalidArgumentError(TrainsnapError, ValueError):
    """The caller passed something trainsnap cannot work with (a bad root, a bad key, a value
    that is neither tensor nor plain data, a bad option)."""
