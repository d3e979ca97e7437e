"""The one door between ranks: every cross-rank step of a protocol is a call here.

A step is a per-rank function, a coordinator function, and one outcome every rank learns:

* :func:`all_reduce`: (all ranks) ``local()``; (coordinator) ``reduce`` of every rank's result;
  (all ranks) the coordinator's one result.
* :func:`reduce_scatter`: the same, but ``reduce`` makes one result per rank and each rank gets
  its own.
* :func:`scatter_shared`: :func:`reduce_scatter` whose ``reduce`` also makes objects several
  ranks read (parts of a manifest): each is put in the store once, however many ranks read it.
* :func:`decide`: (coordinator) ``decide()``; (all ranks) its result. No gather: a decision of
  the coordinator's alone, such as which snapshot is the latest.
* :func:`vote`: (all ranks) a boolean; (all ranks) whether every rank said yes (or, with
  ``rule=any``, whether one did), such as "every marker landed" or "the failure is damage".

A failure anywhere fails the step on every rank, never leaving a rank waiting. Whatever
``local`` raises on a rank -- a :class:`~trainsnap.errors.TrainsnapError`, an ``OSError``, a
bug, and also ``KeyboardInterrupt`` or ``SystemExit`` -- is sent to the coordinator as a
:class:`~trainsnap.errors.RankFailure` (rank, kind, message, step) in place of that rank's part;
the coordinator then does not reduce, and sends every rank every failure. What ``reduce`` raises
is sent the same way, as the coordinator's failure, and a rank lost during the gather (dead,
hung, or gone from the session with an error outside a step) is a failure of kind ``PeerLost``.
Each rank then raises:

* the rank that failed: its own error, as it was raised (its traceback intact);
* every other rank: ``failed(failures)``, the error of the operation's kind (a save's
  ``CommitFailedError``, a load's ``LoadFailedError``) naming each failing rank, its cause and
  the step, e.g. ``rank 2 failed in save/report: OSError: [Errno 5] ...``; a ``TrainsnapError``
  of a public kind raised by the coordinator's ``reduce`` is raised as that kind, "found by the
  coordinator";
* a rank whose coordinator was lost: :class:`~trainsnap.protocol.control_plane.PeerLost`.

The same code serves one process (:class:`~trainsnap.protocol.control_plane.LocalComm`): its own
error is raised as it is.

Cost: one gather and one broadcast (or scatter) through the control plane, O(world size) store
operations; :func:`decide` skips the gather. A failure costs nothing more: it travels in the
messages the step sends anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from trainsnap import errors
from trainsnap.errors import RankFailure, TrainsnapError
from trainsnap.protocol.control_plane import Comm, PeerLost, Session

__all__ = [
    "Failure",
    "Shared",
    "all_reduce",
    "decide",
    "peer_lost",
    "reduce_scatter",
    "scatter_shared",
    "vote",
]

T = TypeVar("T")
R = TypeVar("R")

Failure = Callable[[dict[int, RankFailure]], TrainsnapError]
"""Makes the error a rank raises when other ranks failed, from every failed rank's record (by
rank): a save's ``CommitFailedError``, a load's ``LoadFailedError``, ... Pass the records on as
``rank_errors=`` so that the error names each rank and its cause."""


@dataclass(frozen=True, slots=True)
class _Failed:
    """What the coordinator sends instead of a result when ranks failed."""

    failures: dict[int, RankFailure]
    by_reduce: bool = False
    """Whether it is the coordinator's ``reduce`` that failed (its one record)."""

    def error(self, failed: Failure) -> TrainsnapError:
        """The error a rank raises on learning this outcome."""
        if self.by_reduce:
            (record,) = self.failures.values()
            kind = getattr(errors, record.kind, None) if record.kind in errors.__all__ else None
            if isinstance(kind, type) and issubclass(kind, TrainsnapError):
                return kind(f"{record.message} (found by the coordinator, rank {record.rank})")
        return failed(dict(sorted(self.failures.items())))


def all_reduce(
    comm: Comm,
    session: Session,
    tag: str,
    local: Callable[[], T] | None,
    reduce: Callable[[list[T]], R],
    failed: Failure,
) -> R:
    """Every rank's ``local()`` reduced on the coordinator; its one result on every rank.

    ``local=None``: no gather, ``reduce`` gets ``[None]`` (see :func:`decide`). Raises on every
    rank when ``local`` raised on any rank, when ``reduce`` raised, or when a rank was lost (see
    the module docstring)."""
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


@dataclass(frozen=True, slots=True)
class Shared(Generic[R]):
    """What the ``reduce`` of :func:`scatter_shared` makes: each rank's result, the objects
    several ranks read (by name), and the names each rank reads, in the order it gets them."""

    results: list[R]
    objects: dict[str, Any]
    reads: list[list[str]]


def scatter_shared(
    comm: Comm,
    session: Session,
    tag: str,
    local: Callable[[], T],
    reduce: Callable[[list[T]], Shared[R]],
    failed: Failure,
) -> tuple[R, list[Any]]:
    """:func:`reduce_scatter`, with objects shared between ranks: (coordinator) ``reduce``'s
    objects are published once each before the results are sent; (all ranks) this rank's result
    and the objects it reads. Errors as :func:`all_reduce` (a failed publish is a failure of
    ``reduce``). Cost: one store copy of each object, one fetch per reading rank."""
    made: list[Shared[R]] = []

    def publish(parts: list[T]) -> list[tuple[R, list[str]]]:
        shared = reduce(parts)
        readers = [set(names) for rank, names in enumerate(shared.reads) if rank != comm.rank]
        for name, obj in shared.objects.items():
            session.publish(tag, name, obj, sum(name in names for names in readers))
        made.append(shared)
        return list(zip(shared.results, shared.reads, strict=True))

    result, names = reduce_scatter(comm, session, tag, local, publish, failed)
    if made:  # the coordinator holds the objects
        return result, [made[0].objects[name] for name in names]
    return result, [session.fetch(tag, name) for name in names]


def decide(comm: Comm, session: Session, tag: str, fn: Callable[[], R], failed: Failure) -> R:
    """(coordinator) ``fn()``; (all ranks) its result. What ``fn`` raises is raised on every
    rank (the coordinator's own error there, see the module docstring). One broadcast."""
    return all_reduce(comm, session, tag, None, lambda _: fn(), failed)


def vote(
    comm: Comm,
    session: Session,
    tag: str,
    ok: bool,
    failed: Failure,
    *,
    rule: Callable[[Iterable[bool]], bool] = all,
) -> bool:
    """Every rank's ``ok``, decided alike on every rank: whether all ranks said yes (``rule``:
    ``all``), or whether one did (``any``). One gather and one broadcast; a rank lost during
    the vote fails it (``failed``, or ``PeerLost``), it never counts as a yes or a no."""
    return bool(all_reduce(comm, session, tag, lambda: bool(ok), rule, failed))


class _Running(threading.local):
    """The step whose ``local`` runs on this thread (see :func:`peer_lost`)."""

    session: Session | None = None
    where: str = ""


_running = _Running()


@contextmanager
def _running_step(session: Session, where: str) -> Iterator[None]:
    outer = (_running.session, _running.where)
    _running.session, _running.where = session, where
    try:
        yield
    finally:
        _running.session, _running.where = outer


def peer_lost(rank: int, why: str) -> None:
    """Report ``rank`` lost (``why``: its connection broke) to the step whose ``local`` runs on
    this thread, if any: the coordinator stops waiting for that rank in the step, so that every
    rank learns it within seconds rather than after the heartbeat timeout. The transport that
    saw the connection break calls this (:mod:`trainsnap.protocol.data_group`); the caller then
    raises its own error, which the step tells the others as usual."""
    session = _running.session
    if session is not None:
        session.peer_lost(RankFailure(rank, "PeerLost", why, _running.where))


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
    where = f"{session.name}/{tag}"
    mine: BaseException | None = None
    part: Any = None
    if local is not None:
        try:
            with _running_step(session, where):
                part = local()
        except BaseException as e:  # told to the others, then raised here as it is
            mine, part = e, RankFailure.of(comm.rank, e, where)
    if local is None:
        parts: list[Any] | None = [None] if comm.is_coordinator else None
    else:
        try:
            parts = session.gather(tag, part)
        except PeerLost as e:
            session.failed = True
            if comm.is_coordinator:  # the others learn who was lost, not that the coordinator left
                lost = {r: _lost(r, e, where) for r in e.ranks}
                _send(session, tag, _Failed(lost), comm.world_size, scatter)
            if mine is not None:
                raise mine from e  # this rank's own error says more than the peer it lost
            raise
    decision: Any = None
    reduce_error: BaseException | None = None
    if comm.is_coordinator:
        assert parts is not None
        failures = {r: p for r, p in enumerate(parts) if isinstance(p, RankFailure)}
        if failures:
            decision = _Failed(failures)
        else:
            try:
                decision = reduce(parts)
            except BaseException as e:  # told to the others, then raised here as it is
                reduce_error = e
                decision = _Failed({comm.rank: RankFailure.of(comm.rank, e, where)}, True)
    try:
        outcome = _send(session, tag, decision, comm.world_size, scatter)
    except PeerLost:
        session.failed = True
        raise
    if isinstance(outcome, _Failed) or mine is not None:
        session.failed = True  # every rank learns it: nobody waits for another in the session
    if mine is not None:
        raise mine
    if reduce_error is not None:
        raise reduce_error
    if isinstance(outcome, _Failed):
        raise outcome.error(failed)
    return outcome


def _lost(rank: int, error: PeerLost, where: str) -> RankFailure:
    """The record of ``rank`` as the control plane lost it: the rank's own failure when it left
    the session with one (see ``Session.abandon``), else why it counts as lost."""
    known = error.failures.get(rank)
    if known is not None and known.kind:
        return known
    return RankFailure(rank, "PeerLost", error.ranks[rank], where)


def _send(session: Session, tag: str, decision: Any, world: int, scatter: bool) -> Any:
    """The coordinator's decision on every rank: one for all (a failure, or a broadcast), or
    each rank's own (a scatter of a list of results)."""
    if not scatter:
        return session.broadcast(f"{tag}-outcome", decision)
    if decision is None or isinstance(decision, list):  # a rank's part / the results
        return session.scatter(f"{tag}-outcome", decision)
    return session.scatter(f"{tag}-outcome", [decision] * world)
