"""How the ranks of a load get the manifest: read from storage once, and each rank given its part.

A manifest describes every shard of every rank; at 4,096 ranks it is tens of MiB, and every rank
reading and decoding it would pull that from storage once per rank and plan against shards it
never touches. Instead, on a load of more than one rank:

1. (all ranks) say what their state asks for (:func:`wants_of`: top-level keys, and the regions
   of tensors filled in place by a shard), one digest per top-level key (:func:`classes_of`), so
   that ranks that ask the same under a key -- the data-parallel replicas of a model, even when
   each holds its own ZeRO slice of the optimizer -- fall in one class for it.
2. (coordinator) group the ranks by class and tell each rank which classes it speaks for (their
   first rank).
3. (all ranks) the speakers send those classes' wants: the coordinator takes in each distinct
   wants once, not once per rank.
4. (coordinator) open the snapshot -- marker, manifest checksum, validation, the only read of the
   manifest in the job -- cut one shared part per distinct set of ranks (the classes those ranks
   have in common, :meth:`_Plan._bundles`) and publish it once in the store; send each rank its
   own part (its per-rank entries) and with whom it shares reads, or why there are no parts (the
   same error then stops every rank).
5. (all ranks) fetch their parts and merge them with their own
   (:func:`trainsnap.format.manifest_part.merge`, in the saved order): a rank's metadata is its
   own pieces, not the world's, and the coordinator's work is one cut per distinct set of ranks
   plus one small one per rank.

Steps 1-2 and 3-5 are two steps of :mod:`trainsnap.protocol.collective`: a failure on any rank
(its state's wants, the coordinator's reading of the snapshot) reaches every rank in the decision
it waits for, so no rank waits for an exchange that will not come; a rank that dies is named by
the control plane.
"""

from __future__ import annotations

import bisect
import hashlib
import pickle
import socket
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import NamedTuple

from trainsnap import tunables
from trainsnap.errors import LoadFailedError, RankErrors, TrainsnapError
from trainsnap.format import tree
from trainsnap.format.manifest import Manifest
from trainsnap.format.manifest_part import PartIndex, Wants, merge, tree_order
from trainsnap.format.regions import Box, Region
from trainsnap.protocol import commit, replica_reads
from trainsnap.protocol.collective import Shared, reduce_scatter, scatter_shared
from trainsnap.protocol.control_plane import Comm, Session
from trainsnap.protocol.replica_reads import Sharing
from trainsnap.state.template import Node, failed, root_mapping, tensor_nodes
from trainsnap.storage.base import Storage

MAX_CLASSES = 4096
"""A state with more top-level keys than this (a flat dict of tensors) is one class: its digests
would outweigh the sharing they allow."""
WHOLE = "whole"
"""The name the whole manifest is published under, for ranks whose state cannot say what it
wants."""


def wants_of(walked: Node, tops: Sequence[str] | None = None) -> Wants | None:
    """What loading the walked state (:mod:`trainsnap.state.template`) may read: under
    ``tops`` (default: the state's top-level keys), the regions of its tensors filled in place
    by a shard. None (everything) when the state cannot say, so that its planning reports the
    problem as the load's error. O(nodes); reads the nodes, never the state."""
    try:
        if tops is None:
            tops = [tree.join("", k) for k, _ in root_mapping(walked).children if tree.is_key(k)]
        if failed(walked) is not None:
            return None
        regions: dict[str, list[Region]] = {}
        for node in tensor_nodes(walked):
            item = node.described()
            if item.region != Box.full(item.global_shape):
                regions.setdefault(item.key, []).append(item.region)
    except TrainsnapError:
        return None
    return Wants(tuple(tops), {k: tuple(r) for k, r in regions.items()})


def classes_of(wants: Wants) -> list[Wants]:
    """``wants`` cut by top-level key: what the state asks under each (one class for a state
    of more than :data:`MAX_CLASSES` keys)."""
    if len(wants.tops) > MAX_CLASSES:
        return [wants]
    tops = set(wants.tops)
    under: dict[str, dict[str, tuple[Region, ...]]] = {top: {} for top in wants.tops}
    for key, regions in wants.regions.items():
        top = replica_reads.top_of(key, tops)
        if top is not None:
            under[top][key] = regions
    return [Wants((top,), under[top]) for top in wants.tops]


def digest_of(wants: Wants) -> str:
    items = (wants.tops, sorted(wants.regions.items()))
    return hashlib.blake2b(pickle.dumps(items), digest_size=16).hexdigest()


def manifest_for(
    storage: Storage,
    snapshot_id: str,
    wanted: Callable[[], Wants | None],
    comm: Comm,
    session: Session,
) -> tuple[Manifest, Sharing, bool]:
    """The manifest of ``snapshot_id`` as far as this rank's state needs it (``wanted()``, asked
    in a world of more than one; the whole manifest in a world of one); with which ranks it
    shares the reads of which top-level keys; and whether any ranks share reads in this load
    (the same on every rank: when it is true, every rank takes part in making the data group,
    :func:`replica_reads.data_group`). Raises on every rank what failed on any (the
    coordinator's kind of error where opening the snapshot failed there)."""
    if comm.world_size == 1:
        return commit.open_snapshot(storage, snapshot_id), [], False
    classes: list[tuple[str, Wants]] | None = None  # (digest, wants) of each of this rank's
    plans: list[_Plan] = []  # the coordinator's, made in step 2

    def digests() -> tuple[list[str] | None, str]:  # step 1
        nonlocal classes
        wants = wanted()
        classes = None if wants is None else [(digest_of(c), c) for c in classes_of(wants)]
        return None if classes is None else [d for d, _ in classes], socket.gethostname()

    def speakers(said: list[tuple[list[str] | None, str]]) -> list[list[int]]:  # step 2
        plans.append(_Plan(said))
        return plans[0].speakers

    failed = partial(_not_opened, snapshot_id)
    speaks = reduce_scatter(comm, session, "wants-digest", digests, speakers, failed)

    def spoken() -> list[tuple[str, Wants]] | None:  # step 3
        if classes is None:
            return None
        return [classes[i] for i in speaks] or None

    def parts(heard: list[list[tuple[str, Wants]] | None]) -> Shared[_Part]:  # step 4
        return plans[0].publish(storage, snapshot_id, heard, comm, "://" not in storage.url)

    mine, shared = scatter_shared(comm, session, "wants", spoken, parts, failed)
    parts_read = shared if mine.own is None else [*shared, mine.own]
    return merge(parts_read), mine.sharing, mine.share


def _not_opened(snapshot_id: str, ranks: RankErrors) -> TrainsnapError:
    return LoadFailedError(
        f"opening snapshot {snapshot_id} for the load failed on {len(ranks)} rank(s); nothing "
        "was read",
        snapshot_id=snapshot_id,
        rank_errors=ranks,
    )


class _Part(NamedTuple):
    """What a rank is sent besides the shared parts it reads: its own part of the manifest
    (None: it reads the whole), with whom it shares reads, whether any rank does."""

    own: Manifest | None
    sharing: Sharing
    share: bool


def _joined(classes: list[Wants]) -> Wants:
    """One wants for several classes (of different top-level keys)."""
    if len(classes) == 1:
        return classes[0]
    regions = {key: r for wants in classes for key, r in wants.regions.items()}
    return Wants(tuple(top for wants in classes for top in wants.tops), regions)


class _Plan:
    """(coordinator) The classes of a load's ranks, and what each rank is sent."""

    def __init__(self, said: list[tuple[list[str] | None, str]]) -> None:
        self.digests = [digests for digests, _ in said]
        self.hosts = [host for _, host in said]
        self.members: dict[str, list[int]] = {}  # ranks in order: sorted
        for rank, digests in enumerate(self.digests):
            for digest in [WHOLE] if digests is None else digests:
                self.members.setdefault(digest, []).append(rank)
        self.speakers = [
            [i for i, d in enumerate(digests or ()) if self.members[d][0] == rank]
            for rank, digests in enumerate(self.digests)
        ]
        self._spread: dict[tuple[int, ...], bool] = {}

    def publish(
        self,
        storage: Storage,
        snapshot_id: str,
        heard: list[list[tuple[str, Wants]] | None],
        comm: Comm,
        local: bool,
    ) -> Shared[_Part]:
        """Read the manifest, cut each bundle's part (:meth:`_bundles`, published once by the
        collective); what each rank is sent: its own part, its sharing, whether any rank shares,
        and the names of the bundles' parts it reads."""
        manifest = commit.open_snapshot(storage, snapshot_id)
        index = PartIndex(manifest)
        wants = {digest: w for said in heard for digest, w in (said or ())}
        position = {top: i for i, top in enumerate(tree_order(manifest.tree))}
        objects: dict[str, Manifest] = {}
        bundle_of: dict[str, str] = {}
        for bundle in self._bundles(wants, position):
            name = bundle[0]
            objects[name] = (
                manifest if name == WHOLE else index.shared(_joined([wants[d] for d in bundle]))
            )
            bundle_of.update(dict.fromkeys(bundle, name))
        mode = replica_reads.mode(comm.world_size)
        sharing = [self._sharing(rank, wants, mode, local) for rank in range(len(self.digests))]
        share = any(sharing)
        results, reads = [], []
        for rank, digests in enumerate(self.digests):
            own = None if digests is None else index.own([wants[d] for d in digests], rank)
            classes = [WHOLE] if digests is None else digests
            results.append(_Part(own, sharing[rank], share))
            reads.append(list(dict.fromkeys(bundle_of[d] for d in classes)))
        return Shared(results, objects, reads)

    def _bundles(self, wants: Mapping[str, Wants], position: Mapping[str, int]) -> list[list[str]]:
        """The classes bundled by their ranks: one part is published and fetched per distinct
        set of ranks, not per class. Replicas that want the same under every key (a reshard to
        fewer ranks) fetch one part; a tensor-parallel rank whose layers alternate between
        keys every rank shares (norms) and keys only its replicas share (its column slices)
        fetches two, not two per layer (the merge puts the keys back in the saved order).
        Each bundle: its classes' digests, in the tree's order; the bundles in the order of
        their first keys."""

        def first(digest: str) -> int:
            tops = wants[digest].tops
            return min((position.get(top, len(position)) for top in tops), default=0)

        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for _, digest in sorted((first(d), d) for d in self.members if d != WHOLE):
            by_ranks.setdefault(tuple(self.members[digest]), []).append(digest)
        return ([[WHOLE]] if WHOLE in self.members else []) + list(by_ranks.values())

    def _sharing(self, rank: int, wants: Mapping[str, Wants], mode: int, local: bool) -> Sharing:
        """With whom ``rank`` shares reads, by top-level key: the ranks of each of its classes
        (their wants under that key are the same: data-parallel replicas of those tensors), cut
        into consecutive groups of at most ``replica_group_max``, when sharing helps (``mode``
        2: always; 1: when the storage is not a local file system -- an object store charges
        every request -- or the group spans hosts, whose page caches do not share what one of
        them read; 0: never). A state that cannot say what it wants shares nothing."""
        digests = self.digests[rank]
        if mode == 0 or digests is None:
            return []
        size = max(2, tunables.get().replica_group_max)
        by_members: dict[tuple[int, ...], list[str]] = {}
        for digest in digests:
            members = self.members[digest]
            first = bisect.bisect_left(members, rank) // size * size
            group = tuple(members[first : first + size])
            if len(group) > 1 and (mode == 2 or not local or self._spans_hosts(group)):
                by_members.setdefault(group, []).extend(wants[digest].tops)
        return [(members, tuple(tops)) for members, tops in sorted(by_members.items())]

    def _spans_hosts(self, group: tuple[int, ...]) -> bool:
        spread = self._spread.get(group)
        if spread is None:
            spread = self._spread[group] = len({self.hosts[r] for r in group}) > 1
        return spread
