"""Objects between nodes' memory tiers: over the checkpoint-data process group, never through a
shared file system and never in the training group's collectives.

Two primitives, each posted whole (every send and receive of the step at once) and then awaited,
so that the order of the operations between any two ranks is the order of the lists every rank
derives alike:

* :func:`swap`: small messages (a length, then the bytes), e.g. the list of objects a rank is
  about to send, or the answer saying which of them the receiver lacks.
* :func:`move`: objects, each read by its sender from its own node's directory and written by
  its receiver into its own, after the receiver checked its content address (the name is a
  digest of the object's size and block digests, so a copy damaged in memory or on the way
  cannot pass for it).

A rank never reads or writes another node's directory: the bytes travel over the group. A rank
whose read fails still sends (zeros) so that no peer waits for bytes that will not come; the
transfer is reported failed. A peer that dies makes the waits fail (connection closed) or time
out: :class:`~trainsnap.errors.CommitFailedError` naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainsnap import faults
from trainsnap.errors import CommitFailedError
from trainsnap.format.checksums import Hasher

log = logging.getLogger(__name__)


def checkpoint_data_group() -> Any:
    """The gloo group made for checkpoint data (collective the first time it is made: every
    rank calls this at the same point)."""
    from trainsnap.protocol.replica_reads import data_group

    return data_group()


def _forget_group() -> None:
    from trainsnap.protocol.data_group import forget

    forget()


@dataclass(frozen=True, slots=True)
class Transfer:
    """One object going from ``source``'s node directory to ``target``'s."""

    name: str
    size: int
    source: int
    target: int


def _wait(ops: list[tuple[int, Any]], what: str) -> None:
    for peer, work in ops:
        try:
            work.wait()
        except Exception as e:  # gloo raises RuntimeError subclasses for a lost peer
            _forget_group()
            raise CommitFailedError(
                f"the memory tier's exchange of {what} with rank {peer} failed: {e} (the rank "
                "died, hung or is unreachable)",
                rank_errors={peer: f"lost during the exchange of {what}: {e}"},
            ) from e


def swap(
    outgoing: Mapping[int, bytes], incoming: Sequence[int], group: Any, what: str
) -> dict[int, bytes]:
    """Send ``outgoing[peer]`` to each peer and receive one message from each rank of
    ``incoming``; returns them by sender. Two rounds: the lengths, then the bytes."""
    import torch.distributed as dist

    sizes = {peer: torch.zeros(1, dtype=torch.int64) for peer in incoming}
    ops = [(p, dist.isend(torch.tensor([len(b)]), p, group=group)) for p, b in outgoing.items()]
    ops += [(p, dist.irecv(sizes[p], p, group=group)) for p in incoming]
    _wait(ops, what)
    bodies = {p: torch.empty(int(sizes[p].item()), dtype=torch.uint8) for p in incoming}
    ops = [
        (p, dist.isend(torch.frombuffer(bytearray(b), dtype=torch.uint8), p, group=group))
        for p, b in outgoing.items()
        if b
    ]
    ops += [(p, dist.irecv(bodies[p], p, group=group)) for p in incoming if bodies[p].numel()]
    _wait(ops, what)
    return {p: bodies[p].numpy().tobytes() for p in incoming}


def move(
    transfers: Sequence[Transfer],
    rank: int,
    group: Any,
    read: Callable[[str], bytes],
    write: Callable[[str, memoryview], None],
    hasher: Hasher,
) -> tuple[list[Transfer], int]:
    """This rank's part of ``transfers`` (the same list, in the same order, on every rank):
    send what it is the source of (``read(name)``), receive what it is the target of, check
    each received object's content address and ``write`` it. Returns the transfers that
    failed on this rank (a source that could not read, a copy that did not verify) and the
    bytes received. Raises :class:`CommitFailedError` when a peer is lost."""
    import torch.distributed as dist

    ops: list[tuple[int, Any]] = []
    failed: list[Transfer] = []
    received: list[tuple[Transfer, torch.Tensor]] = []
    for t in transfers:
        if t.target == rank and t.source != rank:
            buffer = torch.empty(t.size, dtype=torch.uint8)
            received.append((t, buffer))
            if t.size:
                ops.append((t.source, dist.irecv(buffer, t.source, group=group)))
    for t in transfers:
        if t.source != rank or t.target == rank:
            continue
        try:
            data = read(t.name)
            if len(data) != t.size:
                raise OSError(f"{len(data)} bytes where {t.size} were expected")
        except OSError as e:
            log.warning("object %s cannot be sent to rank %d: %s", t.name, t.target, e)
            failed.append(t)
            data = bytes(t.size)
        faults.point("replicate_object")
        if t.size:
            tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            ops.append((t.target, dist.isend(tensor, t.target, group=group)))
    _wait(ops, "objects")
    nbytes = 0
    for t, buffer in received:
        view = memoryview(buffer.numpy().data).cast("B")
        if hasher.object_name(t.size, hasher.block_digests(view)) != t.name:
            log.warning("the copy of object %s from rank %d does not verify", t.name, t.source)
            failed.append(t)
            continue
        write(t.name, view)
        nbytes += t.size
    return failed, nbytes
