"""How the ranks of a load get the manifest: read from storage once, and each rank given its part.

A manifest describes every shard of every rank; at 4,096 ranks it is tens of MiB, and every rank
reading and decoding it would pull that from storage once per rank and plan against shards it
never touches. Instead, on a load of more than one rank:

1. (all ranks) say what their state asks for (:func:`wants_of`: top-level keys, and the regions
   of tensors filled in place by a shard), as a digest.
2. (coordinator) group the ranks by digest (data-parallel replicas share one) and broadcast the
   rank that speaks for each group.
3. (all ranks) those ranks send their wants.
4. (coordinator) open the snapshot -- marker, manifest checksum, validation, the only read of the
   manifest in the job -- cut one part per group (:mod:`trainsnap.format.manifest_part`, with
   the per-rank entries of the group's ranks) and publish it once in the store; broadcast that
   the parts are ready, or why there are none (the same error then stops every rank).
5. (all ranks) fetch their group's part: a rank's metadata is its own pieces, not the world's.

A failure on the coordinator at any step is broadcast in the decision the ranks wait for, so no
rank waits for an exchange that will not come; a rank that dies is named by the heartbeat.
"""

from __future__ import annotations

import hashlib
import pickle
import socket
from collections.abc import Mapping
from typing import Any

from trainsnap.errors import TrainsnapError
from trainsnap.format import tree
from trainsnap.format.manifest import Manifest
from trainsnap.format.manifest_part import PartIndex, Wants
from trainsnap.format.regions import Box, Region
from trainsnap.protocol import commit, replica_reads
from trainsnap.protocol.control_plane import Comm, Session
from trainsnap.protocol.outcome import decided, told
from trainsnap.protocol.replica_reads import Sharing
from trainsnap.state.capture import is_stateful, state_dict_of, targets
from trainsnap.state.train_state import TrainState
from trainsnap.storage.base import Storage


def wants_of(state: Any) -> Wants | None:
    """What loading ``state`` may read; None (everything) when the state cannot say, so that
    its planning reports the problem as the load's error."""
    try:
        if isinstance(state, TrainState):
            tops, templates = state.load_wants()
        else:
            root = state
            if is_stateful(state) and not isinstance(state, Mapping):
                root = state_dict_of(state, "")
            tops = [tree.join("", k) for k in root if tree.is_key(k)]
            templates = root
        regions: dict[str, list[Region]] = {}
        for item in targets(templates).tensors:
            if item.region != Box.full(item.global_shape):
                regions.setdefault(item.key, []).append(item.region)
    except TrainsnapError:
        return None
    return Wants(tuple(tops), {k: tuple(r) for k, r in regions.items()})


def manifest_for(
    storage: Storage, snapshot_id: str, state: Any, comm: Comm, session: Session
) -> tuple[Manifest, Sharing, bool]:
    """The manifest of ``snapshot_id`` as far as this rank's ``state`` needs it (the whole
    manifest in a world of one); with which ranks it shares the reads of which top-level keys;
    and whether any ranks share reads in this load (the same on every rank: when it is true,
    every rank takes part in making the data group, :func:`replica_reads.data_group`)."""
    if comm.world_size == 1:
        return commit.open_snapshot(storage, snapshot_id), [], False
    wants = wants_of(state)
    digest = hashlib.blake2b(pickle.dumps(wants), digest_size=16).hexdigest()
    error: TrainsnapError | None = None
    speakers: dict[str, list[int]] = {}
    hosts: list[str] = []
    try:
        said_digests = session.gather("wants-digest", (digest, socket.gethostname()))
        if said_digests is not None:
            speakers = _groups([d for d, _ in said_digests])
            hosts = [h for _, h in said_digests]
    except TrainsnapError as e:
        error = _only_on_coordinator(e, comm)
    coordinator = comm.coordinator
    speakers = decided(session.broadcast("wants-from", told(speakers, error)), error, coordinator)
    asked = any(ranks[0] == comm.rank for ranks in speakers.values())
    mine: tuple[Manifest, Sharing] | None = None
    share = False
    try:
        said = session.gather("wants", wants if asked else None)
        if said is not None:
            mode = replica_reads.mode(comm.world_size)
            sharing = _sharing(speakers, said, hosts, mode, local="://" not in storage.url)
            share = any(sharing.values())
            mine = _publish(storage, snapshot_id, speakers, said, sharing, digest, comm, session)
    except TrainsnapError as e:
        error = _only_on_coordinator(e, comm)
    share = decided(session.broadcast("manifest-parts", told(share, error)), error, coordinator)
    if mine is None:
        mine = session.fetch("manifest-part", digest)
    part, shared = mine
    return part, shared, share


def _only_on_coordinator(error: TrainsnapError, comm: Comm) -> TrainsnapError:
    """A coordinator's failure is broadcast to the others; any other rank's is raised."""
    if not comm.is_coordinator:
        raise error
    return error


def _groups(digests: list[str]) -> dict[str, list[int]]:
    """Ranks by the digest of their wants; the first of each group speaks for it."""
    groups: dict[str, list[int]] = {}
    for rank, digest in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
    return groups


def _publish(
    storage: Storage,
    snapshot_id: str,
    groups: dict[str, list[int]],
    said: list[Any],
    sharing: dict[str, Sharing],
    own_digest: str,
    comm: Comm,
    session: Session,
) -> tuple[Manifest, Sharing]:
    """(coordinator) Read the manifest, publish each group's part with its sharing; return the
    coordinator's own."""
    manifest = commit.open_snapshot(storage, snapshot_id)
    index = PartIndex(manifest)
    mine: tuple[Manifest, Sharing] = (manifest, [])
    for digest, ranks in groups.items():
        wants = said[ranks[0]]
        part = manifest if wants is None else index.part(wants, ranks)
        readers = sum(1 for r in ranks if r != comm.rank)
        session.publish("manifest-part", digest, (part, sharing[digest]), readers)
        if digest == own_digest:
            mine = (part, sharing[digest])
    return mine


def _sharing(
    groups: dict[str, list[int]], said: list[Any], hosts: list[str], mode: int, local: bool
) -> dict[str, Sharing]:
    """(coordinator) For each group, the ranks it shares reads with, by top-level key: the
    ranks of every group whose wants under that key are the same (data-parallel replicas of
    those tensors), when sharing helps (``mode`` 2: always; 1: when the storage is not a
    local file system -- an object store charges every request -- or the replicas are on
    different hosts, whose page caches do not share what one of them read; 0: never). A state
    that cannot say what it wants shares nothing."""
    tops_of = {d: _top_digests(said[ranks[0]]) for d, ranks in groups.items()}
    classes: dict[tuple[str, str], list[int]] = {}
    for digest, ranks in groups.items():
        for top_and_sub in (tops_of[digest] or {}).items():
            classes.setdefault(top_and_sub, []).extend(ranks)
    out: dict[str, Sharing] = {}
    for digest in groups:
        by_members: dict[tuple[int, ...], list[str]] = {}
        for top, sub in (tops_of[digest] or {}).items():
            members = tuple(sorted(classes[top, sub]))
            spread = len({hosts[m] for m in members}) > 1
            if len(members) > 1 and (mode == 2 or (mode == 1 and (spread or not local))):
                by_members.setdefault(members, []).append(top)
        out[digest] = [(members, tuple(tops)) for members, tops in sorted(by_members.items())]
    return out


def _top_digests(wants: Wants | None) -> dict[str, str] | None:
    """A digest of what ``wants`` asks under each of its top-level keys (the regions of the
    tensors under it)."""
    if wants is None:
        return None
    tops = set(wants.tops)
    under: dict[str, list[Any]] = {top: [] for top in wants.tops}
    for key, regions in sorted(wants.regions.items()):
        top = replica_reads.top_of(key, tops)
        if top is not None:
            under[top].append((key, regions))
    return {
        top: hashlib.blake2b(pickle.dumps(items), digest_size=16).hexdigest()
        for top, items in under.items()
    }
