"""The one transport for checkpoint bytes between ranks: a gloo group of its own, and one way to
post and await point-to-point transfers on it.

Control-plane agreement goes through :mod:`trainsnap.protocol.collective`; bytes that go from
one rank's memory to another's (replicas sharing their reads, a memory tier copying objects to
its partner nodes) go here, never through the store and never over the training group, so that
no collective of the training loop can be in flight on it.

Use: every rank that takes part calls :func:`group` at the same point (it is collective the
first time), posts its sends and receives with :func:`send` / :func:`receive` (each returns a
:class:`Posted`), then :func:`wait` for all of them, naming what they carry and the error kind
of the operation they are part of (a load's ``LoadFailedError``, a save's
``CommitFailedError``)::

    posted = [data_group.send(buf, peer, grp), data_group.receive(out, peer, grp)]
    data_group.wait(posted, "the read plans", LoadFailedError)

A peer that dies makes the wait fail at once (its connection closes) or time out after the
heartbeat: :func:`wait` forgets the group (a member may be gone), reports the peer lost to the
cross-rank step running on this thread (:func:`trainsnap.protocol.collective.peer_lost`: the
coordinator stops waiting for it there, so every rank learns within seconds), and raises the
caller's kind of error naming it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from trainsnap.errors import CommitFailedError, LoadFailedError
from trainsnap.protocol.collective import peer_lost
from trainsnap.protocol.store_ops import Job, job_of

__all__ = ["Posted", "forget", "group", "job", "receive", "send", "wait"]

FailureKind = type[CommitFailedError] | type[LoadFailedError]
"""The error :func:`wait` raises: that of the operation the transfer is part of."""


class Posted(NamedTuple):
    """One transfer posted to a peer, to be awaited with :func:`wait`."""

    peer: int
    work: Any


def job() -> Job:
    """This process's :class:`~trainsnap.protocol.store_ops.Job` of the default process
    group's store: it owns the checkpoint-data group."""
    import torch.distributed as dist

    return job_of(dist.distributed_c10d._get_default_store())


def group() -> Any:
    """The gloo group for checkpoint data, owned by the job (:meth:`Job.data_group
    <trainsnap.protocol.store_ops.Job.data_group>`); every rank must call this at the same point
    (it is collective the first time)."""
    return job().data_group()


def forget() -> None:
    """Drop the group after a failed exchange: a member may be gone; the next :func:`group`
    makes a fresh one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        job().forget_data_group()


def send(tensor: torch.Tensor, peer: int, process_group: Any) -> Posted:
    """Post the send of ``tensor`` (contiguous, CPU) to ``peer``."""
    import torch.distributed as dist

    return Posted(peer, dist.isend(tensor, peer, group=process_group))


def receive(tensor: torch.Tensor, peer: int, process_group: Any) -> Posted:
    """Post the receive of ``peer``'s next send into ``tensor`` (contiguous, CPU, of its size)."""
    import torch.distributed as dist

    return Posted(peer, dist.irecv(tensor, peer, group=process_group))


def wait(posted: Iterable[Posted], what: str, kind: FailureKind) -> None:
    """Await every transfer of ``posted`` (``what`` they carry, for the message). Raises ``kind``
    naming the peer whose transfer failed, after reporting it lost (see the module docstring).
    O(len(posted))."""
    for peer, work in posted:
        try:
            work.wait()
        except Exception as e:  # gloo raises RuntimeError subclasses for a lost peer
            forget()
            why = f"its connection broke during the exchange of {what}: {e}"
            peer_lost(peer, why)
            raise kind(
                f"the exchange of {what} with rank {peer} failed: {e} (the rank died, hung or "
                "is unreachable)",
                rank_errors={peer: f"lost during the exchange of {what}: {e}"},
            ) from e
