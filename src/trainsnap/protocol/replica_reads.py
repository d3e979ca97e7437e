"""Replicas share their reads: each byte a group of ranks needs is pulled from storage once.

Ranks whose states ask the same under a top-level key (data-parallel replicas of those tensors:
same keys, same shards) share the reads of that key (:mod:`trainsnap.protocol.manifest_share`
finds them: a :data:`Sharing`). For each set of members, the tensors they share are split among
them, balanced by bytes; each member reads and verifies its share into its own destinations,
then sends it to the other members, which receive it straight into theirs.
The bytes travel over a gloo process group made for checkpoint data, never the training
group, so no collective of the training loop can be in flight on it.

1. (all members) the same split, computed by each from the same targets: tensors in the order
   of their bytes in the snapshot, cut into one run of about equal bytes per member, never
   inside a checksum block.
2. (all members) check what they will read and receive (coverage), read their values.
3. (all members) tell every other member whether that worked: a member that failed reads
   nothing, and every member raises, naming it, before any tensor is touched.
4. (all members) post the receives of the others' shares, straight into the destinations;
   read and verify their own share batch by batch
   (:func:`trainsnap.protocol.rank_load.load_tensors`), sending each batch to the other members
   as soon as it is verified, so reads and sends overlap; then one status byte each: whether
   its share was read (a member whose read failed still sends the rest unread, and the
   others raise naming it rather than use it).

A member that dies makes the others' sends and receives fail (the connection closes) or time
out after the heartbeat: every survivor raises, naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from trainsnap import faults, tunables
from trainsnap.errors import LoadFailedError
from trainsnap.protocol import data_group as transport

log = logging.getLogger(__name__)

Sharing = list[tuple[tuple[int, ...], tuple[str, ...]]]
"""(members, top-level keys): the ranks (sorted, this one among them) that need the same under
those keys of the state, and share their reads."""


@dataclass(slots=True)
class Replicas:
    """With whom this rank shares which reads, and the group their bytes travel over."""

    sharing: Sharing
    rank: int
    process_group: Any
    told: bool = False
    """Whether the others were told how this rank's reads went (step 3)."""
    _by_top: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_top = {top: members for members, tops in self.sharing for top in tops}

    def members_of(self, key: str) -> tuple[int, ...] | None:
        """The ranks that share the reads of ``key`` (None: this rank reads it alone)."""
        top = top_of(key, self._by_top)
        return None if top is None else self._by_top[top]

    @property
    def peers(self) -> list[int]:
        """Every rank this one shares any read with."""
        return sorted({m for members, _ in self.sharing for m in members if m != self.rank})


def top_of(key: str, tops: Collection[str]) -> str | None:
    """The top-level key among ``tops`` that ``key`` is (or lies under)."""
    if key in tops:
        return key
    for i, char in enumerate(key):
        if char == "." and key[:i] in tops:
            return key[:i]
    return None


def mode(world_size: int) -> int:
    """How this job shares reads: 0 never (no default process group of this world with gloo,
    or ``TRAINSNAP_REPLICA_READS=0``), 1 when it helps (the default), 2 always."""
    import torch.distributed as dist

    wanted = tunables.get().replica_reads
    if not wanted or not dist.is_available() or not dist.is_initialized():
        return 0
    if dist.get_world_size() != world_size or not dist.is_gloo_available():
        return 0
    return min(int(wanted), 2)


def data_group() -> Any:
    """The checkpoint-data group (:func:`trainsnap.protocol.data_group.group`); every rank must
    call this at the same point (it is collective the first time)."""
    return transport.group()


Place = tuple[str, int, str, int]
"""Where a tensor's bytes are stored: (object name, offset) of its first byte, (object name,
end) of its last chunk. Names, not a manifest's indices: members may hold different parts."""


def stored_order(
    shared: list[tuple[str, torch.Tensor, Place]],
) -> list[tuple[str, torch.Tensor, Place]]:
    """Tensors in the order of their bytes in the snapshot: the same on every member."""
    return sorted(shared, key=lambda item: (item[2], item[0]))


def split(
    members: tuple[int, ...], shared: list[tuple[str, torch.Tensor, Place]], block_size: int
) -> dict[str, int]:
    """(step 1) Key -> the member that reads it. Tensors in the order of their bytes in the
    snapshot are cut into one run per member of about equal bytes, and only where no checksum
    block is shared: a member verifies whole blocks, so a block split between two members would
    be read by both."""
    ordered = stored_order(shared)
    total = sum(_nbytes(work) for _, work, _ in ordered)
    owner: dict[str, int] = {}
    member, done = 0, 0
    previous: Place | None = None
    for key, work, place in ordered:
        reached = done >= (member + 1) * total / len(members)
        if reached and previous is not None and _apart(previous, place, block_size):
            member = min(member + 1, len(members) - 1)
        owner[key] = members[member]
        done += _nbytes(work)
        previous = place
    return owner


def _apart(before: Place, after: Place, block_size: int) -> bool:
    """Whether the last block of ``before`` is not the first block of ``after``."""
    last = (before[2], (before[3] - 1) // block_size)
    return last != (after[0], after[1] // block_size)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def start(group: Replicas, failure: BaseException | None) -> None:
    """(step 3) Tell the other members whether this member planned its reads, hear theirs:
    raise ``failure``, or name the members that could not plan, before any member reads."""
    failed = tell(group, failure)
    if failure is not None:
        raise failure
    if failed:
        raise LoadFailedError(
            f"{len(failed)} replica(s) of this rank could not plan their share of the snapshot's "
            "reads (their own errors say why)",
            rank_errors=failed,
        )


def tell(group: Replicas, failure: BaseException | None) -> dict[int, str]:
    """Tell the other members whether this member planned its reads; the members that say
    they could not."""
    group.told = True
    peers = group.peers
    status = {m: torch.zeros(1, dtype=torch.uint8) for m in peers}
    mine = torch.tensor([0 if failure is None else 1], dtype=torch.uint8)
    pg = group.process_group
    posted = [transport.send(mine, m, pg) for m in peers]
    posted += [transport.receive(status[m], m, pg) for m in peers]
    transport.wait(posted, "the replicas' read plans", LoadFailedError)
    return {m: "could not plan its share of the replicas' reads" for m in peers if status[m]}


Held = list[tuple[str, torch.Tensor, tuple[int, ...], Place]]
"""(key, contiguous CPU destination, members sharing its reads, where it is stored) of a rank's
shared tensors."""


class Exchange:
    """(step 4) One member's sends and receives of the shared tensors, started as its reads go.

    Between any two members the tensors go in stored order (by :data:`Place`), which both
    derive alike. The receives are all posted first; each member sends its share as it reads
    and verifies it, batch by batch (:func:`batches`), so reading and sending overlap; after its
    data it sends one status byte: whether its reads worked (a member whose read failed still
    sends the rest unread, so that nobody waits for bytes that will not come, and the others
    raise naming it)."""

    def __init__(self, group: Replicas, held: Held, owner: dict[str, int]) -> None:
        self.group = group
        self._peers_of: dict[str, list[int]] = {}
        self._posted: list[transport.Posted] = []
        self._receivers: set[int] = set()
        self._tensors: dict[str, torch.Tensor] = {}
        senders: set[int] = set()
        for key, work, members, _ in sorted(held, key=lambda h: (h[3], h[0])):
            if work.numel() == 0:
                continue
            data = work.view(-1).view(torch.uint8)
            if owner[key] == group.rank:
                peers = [m for m in members if m != group.rank]
                self._peers_of[key] = peers
                self._tensors[key] = data
                self._receivers.update(peers)
            else:
                senders.add(owner[key])
                self._posted.append(transport.receive(data, owner[key], group.process_group))
        self._status = {m: torch.ones(1, dtype=torch.uint8) for m in sorted(senders)}
        for m, status in self._status.items():
            self._posted.append(transport.receive(status, m, group.process_group))
        faults.point("replica_exchange")

    def send(self, keys: list[str]) -> None:
        """Send the tensors of this member's share among ``keys`` (given in stored order: read
        and verified, or not, see above); the others are not shared."""
        pg = self.group.process_group
        for key in keys:
            for peer in self._peers_of.get(key, ()):
                self._posted.append(transport.send(self._tensors[key], peer, pg))

    def finish(self, failure: BaseException | None) -> None:
        """Send this member's status, wait for every transfer; raise ``failure``, or name the
        members whose reads failed."""
        mine = torch.tensor([0 if failure is None else 1], dtype=torch.uint8)
        pg = self.group.process_group
        self._posted += [transport.send(mine, peer, pg) for peer in sorted(self._receivers)]
        transport.wait(self._posted, "the replicas' tensor data", LoadFailedError)
        if failure is not None:
            raise failure
        failed = {
            m: "failed reading its share of the replicas' reads"
            for m, status in self._status.items()
            if status.item()
        }
        if failed:
            raise LoadFailedError(
                f"{len(failed)} replica(s) of this rank could not read their share of the snapshot "
                "(their own errors say why)",
                rank_errors=failed,
            )


def batches(
    reads: list[tuple[str, int, Place]], block_size: int, parts: int = 8
) -> list[list[str]]:
    """A member's reads (key, bytes, place), in stored order, cut into about ``parts`` batches
    of 8 to 64 MiB, each sent while the next is read; never inside a checksum block (a block
    in two batches would be read twice)."""
    ordered = sorted(reads, key=lambda r: (r[2], r[0]))
    size = min(max(sum(n for _, n, _ in ordered) // parts, 8 << 20), 64 << 20)
    out: list[list[str]] = [[]]
    filled = 0
    previous: Place | None = None
    for key, nbytes, place in ordered:
        if filled >= size and previous is not None and _apart(previous, place, block_size):
            out.append([])
            filled = 0
        out[-1].append(key)
        filled += nbytes
        previous = place
    return [batch for batch in out if batch]
