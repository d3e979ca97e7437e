"""The two cross-rank steps every protocol is made of, with their error handling in one place.

Each protocol step is a per-rank function, a coordinator function, and one outcome every rank
learns:

* :func:`all_reduce`: (all ranks) ``local()``; (coordinator) ``reduce`` of every rank's result;
  (all ranks) the coordinator's one result.
* :func:`reduce_scatter`: the same, but ``reduce`` makes one result per rank and each rank gets
  its own.

A failure anywhere fails the step on every rank, never leaving a rank waiting: a
:class:`~trainsnap.errors.TrainsnapError` raised by ``local`` on a rank is described to the
coordinator, which then does not reduce; one raised by ``reduce`` is sent instead of the result;
a rank lost during the gather is named to the others. Each rank then raises: the rank that
failed its own error (with its traceback), the others the error ``failed`` makes of every rank's
description, or the coordinator's kind of error. The same code serves one process
(:class:`~trainsnap.protocol.control_plane.LocalComm`): its own error is raised as it is.

Cost: one gather and one broadcast (or scatter) through the control plane; ``local=None`` skips
the gather (a decision of the coordinator's alone, such as which snapshot is the latest).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from trainsnap.errors import TrainsnapError
from trainsnap.protocol.control_plane import Comm, PeerLost, Session
from trainsnap.protocol.outcome import decided, describe_error

T = TypeVar("T")
R = TypeVar("R")

Failure = Callable[[dict[int, str]], TrainsnapError]
"""Makes the error a rank raises when other ranks failed, from every failed rank's
description."""


@dataclass(frozen=True, slots=True)
class _Failed:
    """What the coordinator sends instead of a result when ranks failed: rank -> why."""

    ranks: dict[int, str]


@dataclass(frozen=True, slots=True)
class _Refused:
    """What the coordinator sends when ``reduce`` raised: the error's kind and message."""

    kind: str
    message: str


@dataclass(frozen=True, slots=True)
class _RankFailed:
    """What a rank sends instead of its part of a step when ``local`` raised: why. A part that
    succeeded is sent as it is (no wrapper: a step's messages stay the size of their parts)."""

    error: str


def all_reduce(
    comm: Comm,
    session: Session,
    tag: str,
    local: Callable[[], T] | None,
    reduce: Callable[[list[T]], R],
    failed: Failure,
) -> R:
    """Every rank's ``local()`` reduced on the coordinator; its one result on every rank.

    Raises on every rank when ``local`` raised a ``TrainsnapError`` on any rank (see the module
    docstring), when ``reduce`` raised one, or when a rank was lost (``PeerLost``)."""
    return _step(comm, session, tag, local, reduce, failed, scatter=False)  # type: ignore[no-any-return]


def reduce_scatter(
    comm: Comm,
    session: Session,
    tag: str,
    local: Callable[[], T],
    reduce: Callable[[list[T]], list[R]],
    failed: Failure,
) -> R:
    """Every rank's ``local()`` turned on the coordinator into one result per rank; each
    rank's own result on each rank. Errors as :func:`all_reduce`."""
    return _step(comm, session, tag, local, reduce, failed, scatter=True)  # type: ignore[no-any-return]


def _step(
    comm: Comm,
    session: Session,
    tag: str,
    local: Callable[[], Any] | None,
    reduce: Callable[[list[Any]], Any],
    failed: Failure,
    *,
    scatter: bool,
) -> Any:
    mine: TrainsnapError | None = None
    part: Any = None
    if local is not None:
        try:
            part = local()
        except TrainsnapError as e:
            mine, part = e, _RankFailed(describe_error(e))
    decision: Any = None
    reduce_error: TrainsnapError | None = None
    if local is None:
        parts: list[Any] | None = [part] if comm.is_coordinator else None
    else:
        try:
            parts = session.gather(tag, part)
        except PeerLost as e:
            if comm.is_coordinator:  # the others learn who was lost, not that the coordinator left
                _send(session, tag, _Failed(dict(e.ranks)), comm.world_size, scatter)
            raise
    if comm.is_coordinator:
        assert parts is not None
        errors = {r: p.error for r, p in enumerate(parts) if isinstance(p, _RankFailed)}
        if errors:
            decision = _Failed(errors)
        else:
            try:
                decision = reduce(parts)
            except TrainsnapError as e:
                reduce_error, decision = e, _Refused(type(e).__name__, str(e))
    outcome = _send(session, tag, decision, comm.world_size, scatter)
    if mine is not None:
        raise mine
    if reduce_error is not None:
        raise reduce_error
    if isinstance(outcome, _Failed):
        raise failed(outcome.ranks)
    if isinstance(outcome, _Refused):
        decided((outcome.kind, outcome.message), None, comm.coordinator)
    return outcome


def _send(session: Session, tag: str, decision: Any, world: int, scatter: bool) -> Any:
    """The coordinator's decision on every rank: one for all (a failure, or a broadcast), or
    each rank's own (a scatter of a list of results)."""
    if not scatter:
        return session.broadcast(f"{tag}-outcome", decision)
    if decision is None or isinstance(decision, list):  # a rank's part / the results
        return session.scatter(f"{tag}-outcome", decision)
    return session.scatter(f"{tag}-outcome", [decision] * world)
