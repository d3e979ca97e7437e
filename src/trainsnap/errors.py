"""The errors trainsnap raises on purpose.

Every error is a :class:`TrainsnapError`; the subclasses say what kind of thing went wrong so that
callers (and the manager's fallback logic) can react to the kind rather than parse messages. Each
carries what is known of where it happened -- snapshot id, key, rank, path -- as attributes, and
its message says what failed, the likely cause and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

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


class _RankErrors(TrainsnapError):
    """A step of several ranks that failed: each failing rank and its cause.

    Attributes:
        rank_errors: each failing rank and its cause (one line each in ``problems`` too).
    """

    def __init__(
        self,
        message: str,
        *,
        rank_errors: Mapping[int, str] | None = None,
        snapshot_id: str | None = None,
        key: str | None = None,
        path: str | None = None,
        rank: int | None = None,
        problems: Sequence[str] = (),
        see_all: str = "",
    ) -> None:
        errs = dict(rank_errors or {})
        lines = list(problems) or [f"rank {r}: {e}" for r, e in sorted(errs.items())]
        super().__init__(
            message,
            snapshot_id=snapshot_id,
            key=key,
            path=path,
            rank=rank,
            problems=lines,
            see_all=see_all,
        )
        self.rank_errors = errs


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
