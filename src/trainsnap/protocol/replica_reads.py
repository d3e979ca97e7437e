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
2. (all members) read and verify their share (:func:`trainsnap.protocol.rank_load.load_tensors`).
3. (all members) tell every other member whether that worked: a member that failed sends no
   data, and the others raise naming it rather than wait for bytes that will not come.
4. (all members) send their share to every other member, receive the rest, in key order.

A member that dies makes the others' sends and receives fail (the connection closes) or time
out after the heartbeat: every survivor raises, naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from trainsnap import faults, tunables
from trainsnap.errors import CommitFailedError

log = logging.getLogger("trainsnap.load")

_GROUP: dict[str, Any] = {}
"""The checkpoint-data process group, made once per default process group."""


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
    """The gloo group for checkpoint data; every rank must call this at the same point (it is
    collective the first time)."""
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()
    key = f"{id(default)}"
    if key not in _GROUP:
        seconds = float(tunables.get().heartbeat_seconds)
        _GROUP.clear()
        _GROUP[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
    return _GROUP[key]


def forget_group() -> None:
    """Drop the group after a failed exchange: a member may be gone."""
    _GROUP.clear()


Place = tuple[str, int, str, int]
"""Where a tensor's bytes are stored: (object name, offset) of its first byte, (object name,
end) of its last chunk. Names, not a manifest's indices: members may hold different parts."""


def split(
    members: tuple[int, ...], shared: list[tuple[str, torch.Tensor, Place]], block_size: int
) -> dict[str, int]:
    """(step 1) Key -> the member that reads it. Tensors in the order of their bytes in the
    snapshot are cut into one run per member of about equal bytes, and only where no checksum
    block is shared: a member verifies whole blocks, so a block split between two members would
    be read by both."""
    ordered = sorted(shared, key=lambda item: (item[2], item[0]))
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


def tell(group: Replicas, failure: BaseException | None) -> dict[int, str]:
    """(step 3) Tell the other members whether this member's share was read; the members that
    say theirs was not."""
    import torch.distributed as dist

    group.told = True
    peers = group.peers
    status = {m: torch.zeros(1, dtype=torch.uint8) for m in peers}
    mine = torch.tensor([0 if failure is None else 1], dtype=torch.uint8)
    pg = group.process_group
    ops = [dist.P2POp(dist.isend, mine, m, group=pg) for m in peers]
    ops += [dist.P2POp(dist.irecv, status[m], m, group=pg) for m in peers]
    _wait(ops, dist.batch_isend_irecv(ops), "the read status")
    return {m: "failed reading its share of the replicas' reads" for m in peers if status[m]}


def exchange(
    group: Replicas,
    shared: list[tuple[str, torch.Tensor]],
    owner: dict[str, int],
    failure: BaseException | None,
) -> None:
    """(steps 3 and 4) Tell the others whether this member's share was read, then send it to
    the other members of its key's sharing, and receive theirs into ``shared``'s tensors
    (contiguous, on CPU)."""
    import torch.distributed as dist

    failed = tell(group, failure)
    if failure is not None:
        raise failure
    if failed:
        raise CommitFailedError(
            f"{len(failed)} replica(s) of this rank could not read their share of the snapshot "
            "(their own errors say why)",
            rank_errors=failed,
        )
    faults.point("replica_exchange")
    pg = group.process_group
    ops = []
    for key, work in sorted(shared, key=lambda kw: kw[0]):
        members = group.members_of(key)
        if work.numel() == 0 or members is None:
            continue
        data = work.view(-1).view(torch.uint8)
        if owner[key] == group.rank:
            ops += [dist.P2POp(dist.isend, data, m, group=pg) for m in members if m != group.rank]
        else:
            ops.append(dist.P2POp(dist.irecv, data, owner[key], group=pg))
    if ops:
        _wait(ops, dist.batch_isend_irecv(ops), "tensor data")


def _wait(ops: list[Any], works: list[Any], what: str) -> None:
    for op, work in zip(ops, works, strict=True):
        try:
            work.wait()
        except Exception as e:  # gloo raises RuntimeError subclasses for a lost peer
            forget_group()
            peer = int(op.peer)
            raise CommitFailedError(
                f"the replicas' exchange of {what} with rank {peer} failed: {e} (the rank died, "
                "hung or is unreachable)",
                rank_errors={peer: f"lost during the replicas' exchange of {what}: {e}"},
            ) from e
