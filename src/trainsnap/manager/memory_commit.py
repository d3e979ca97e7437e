"""The memory tier's commit: a snapshot is committed on every node, or on none, once every object
has its copies on partner nodes (:class:`ReplicatedCommit`, the memory tier's
:class:`~trainsnap.protocol.commit.Committer`).

The ordinary save protocol writes each rank's objects into its node's directory and sends the
write reports over the control plane (``reports_inline``: a rank never reads another node's
directory). Its commit step then runs here:

1. (coordinator, :meth:`ReplicatedCommit.write`) the manifest and the marker are built by
   ``format/`` -- the marker's ``writer`` says the tier, the job, the writer generation and the
   copies -- and held, not written.
2. (all ranks, :meth:`ReplicatedCommit.settle`) replication over the checkpoint-data group
   (:mod:`trainsnap.protocol.replication`): each rank tells the rank of the same local rank on
   each partner node which objects it wrote (from its own write report); that rank answers which
   it lacks; the objects go over, are checked against their content address and written into
   the partner's directory. The coordinator sends the manifest and the marker to one rank of
   every other node, which checks the manifest against the marker and writes the manifest.
3. (all ranks) one vote on the control plane: any failure anywhere (a partner lost mid-copy, a
   copy that does not verify, a full tmpfs, a superseded writer) and no node gets a marker.
4. (one rank per node) write the marker last.
5. (all ranks) a second vote: did every node's marker land? If not, the markers that landed are
   taken back and every rank raises: committed on every node or on none, as the save reports (a
   crash inside this step can leave it on some nodes: a restore repairs the others' markers from
   them). If so, each node leader applies the tier's retention (:meth:`MemorySaves.retain`).

Every operation on the checkpoint-data group runs on the save's background thread, one memory
save at a time (the manager's saver runs a memory save alone), in the same order on every rank.
The votes use the tier's own control plane (its own session numbering), since they run on that
thread while the training thread opens sessions of its own.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trainsnap import faults
from trainsnap.errors import CommitFailedError, InvalidArgumentError, RankErrors, TrainsnapError
from trainsnap.format.checksums import Hasher
from trainsnap.format.encoding import encode
from trainsnap.format.manifest import Manifest, manifest_key, marker_key
from trainsnap.format.marker import check_manifest_bytes, decode_marker, encode_marker
from trainsnap.manager.memory_nodes import Topology, shortfall
from trainsnap.manager.options import MemoryTier
from trainsnap.protocol import replication
from trainsnap.protocol.collective import all_reduce, vote
from trainsnap.protocol.control_plane import Comm
from trainsnap.protocol.rank_save import WriteReport
from trainsnap.storage.base import Storage

if TYPE_CHECKING:
    from trainsnap.protocol.save_protocol import PendingSave

log = logging.getLogger(__name__)


class NodeDirectories(Protocol):
    """What the commit needs of its tier (:class:`~trainsnap.manager.memory_tier.MemorySaves`)."""

    options: MemoryTier
    comm: Comm
    save_comm: Comm
    storage: Storage
    directory: Path
    topology: Topology | None
    job: str
    generation: int
    newest: str | None

    @property
    def is_leader(self) -> bool: ...

    def has(self, name: str, size: int) -> bool: ...

    def read(self, name: str) -> bytes: ...

    def write(self, name: str, data: memoryview) -> None: ...

    def wrote(self, snapshot_id: str, objects: dict[str, int]) -> None: ...

    def retain(self) -> None: ...

    def check_writer(self) -> None: ...


def rank_objects(report: WriteReport) -> dict[str, int]:
    """Object name -> stored size of every object a rank wrote or reused for a snapshot."""
    return {o.name: o.size if o.stored is None else o.stored for o in report.objects}


class ReplicatedCommit:
    """The memory tier's committer (module docstring); one per tier, one save at a time."""

    reports_inline = True

    def __init__(self, tier: NodeDirectories) -> None:
        self.tier = tier
        self._held: dict[str, tuple[bytes, bytes]] = {}
        """(coordinator) snapshot id -> (manifest, marker) bytes, between write and settle."""
        self._footprint_checked = False

    # -- the protocol's calls ---------------------------------------------------------------

    def prepared(self, pending: PendingSave) -> None:
        """(all ranks, before the tier's first save writes anything) refuse, with the numbers,
        a memory tier whose tmpfs cannot hold ``keep + 1`` snapshots of this node's state and
        its partners' copies. O(files in the node directory), once."""
        if self._footprint_checked:
            return
        tier = self.tier
        assert tier.topology is not None
        topology, local = tier.topology, pending.local
        mine = sum(local.entries[i].nbytes for i, _ in pending.assignment.entries)
        mine += sum(len(local.value_bytes[i]) for i, _ in pending.assignment.values)
        usage = shutil.disk_usage(tier.directory)
        held = sum(p.stat().st_size for p in tier.directory.rglob("*") if p.is_file())
        session = tier.comm.session("memory-footprint")
        try:
            verdict = all_reduce(
                tier.comm,
                session,
                "bytes",
                lambda: (mine, usage.free + held),
                lambda said: shortfall(topology, said, tier.options.keep, str(tier.directory)),
                lambda ranks: CommitFailedError(
                    "the memory tier's footprint check failed", rank_errors=ranks
                ),
            )
        finally:
            session.close()
        self._footprint_checked = True
        if verdict:
            raise InvalidArgumentError(verdict, path=str(tier.directory))

    def write(
        self,
        storage: Storage,
        manifest: Manifest,
        writer: Mapping[str, Any],
        fence: Callable[[], None] | None,
    ) -> None:
        """(coordinator) Step 1: the manifest and marker, built by ``format/``, held."""
        tier = self.tier
        assert tier.topology is not None
        data = encode(manifest)
        if fence is not None:
            fence()
        faults.point("before_manifest")  # the ordinary commit's fault points, at their place
        faults.point("before_marker")
        record = {
            **writer,
            "tier": "memory",
            "copies": tier.topology.copies,
            "job": tier.job,
            "generation": tier.generation,
        }
        self._held[manifest.snapshot_id] = (data, encode_marker(manifest, data, record))

    def settle(self, pending: PendingSave, report: WriteReport, manifest: Manifest | None) -> None:
        """(all ranks) Steps 2 to 5 (module docstring)."""
        sid = pending.snapshot_id
        held = self._held.pop(sid, None)
        objects = rank_objects(report)
        self.tier.wrote(sid, objects)
        tier, comm = self.tier, self.tier.save_comm
        marker: list[bytes] = [held[1] if held else b""]

        def replicate() -> bool:
            try:
                marker[0] = self._replicate(sid, objects, held, pending.hasher) or marker[0]
            except OSError as e:  # a full tmpfs (ENOSPC): this rank's part failed, said so
                raise CommitFailedError(
                    f"memory snapshot {sid}: writing a copy or the manifest into "
                    f"{tier.storage.url} failed ({e}); check the free space there",
                    snapshot_id=sid,
                    path=str(tier.storage.url),
                ) from e
            if tier.is_leader:  # a superseded writer fails the vote everywhere
                tier.check_writer()
            return True

        def failed(ranks: RankErrors) -> TrainsnapError:
            return CommitFailedError(
                f"memory snapshot {sid} was not committed: {len(ranks)} rank(s) failed to "
                "copy it to their partner nodes; the previous memory snapshot stays the newest",
                snapshot_id=sid,
                rank_errors=ranks,
            )

        self._vote(comm, "replicated", replicate, failed)
        error: Exception | None = None
        if tier.is_leader:
            try:
                if held is not None:  # the coordinator; the other leaders wrote theirs
                    tier.storage.put(manifest_key(sid), held[0])
                tier.storage.put(marker_key(sid), marker[0])
            except (TrainsnapError, OSError) as e:  # a full tmpfs is an OSError (ENOSPC)
                error = e
        if self._landed(comm, error is None):
            if tier.is_leader:
                tier.newest = sid
                tier.retain()
            return
        if tier.is_leader and error is None:
            # Another node's marker failed: take this one back (marker first, as any delete),
            # so the snapshot is committed on every node or on none, as the save reports.
            tier.storage.delete(marker_key(sid))
        raise CommitFailedError(
            f"memory snapshot {sid}: a node's marker could not be written"
            + (f" (this node's: {error})" if error is not None else "")
            + ", so the markers that landed were taken back: not committed, the previous memory "
            "snapshot stays the newest. Check the free space of the memory tier's directory on "
            "every node.",
            snapshot_id=sid,
        ) from error

    # -- the steps ---------------------------------------------------------------------------

    def _vote(
        self,
        comm: Any,
        tag: str,
        local: Callable[[], bool],
        failed: Callable[[RankErrors], TrainsnapError] | None,
    ) -> bool:
        """(all ranks) Whether ``local()`` was true on every rank; a rank whose ``local``
        raised fails the step everywhere with ``failed`` (or counts as a no without it)."""

        def lost(ranks: RankErrors) -> TrainsnapError:
            return CommitFailedError(
                f"memory commit: {len(ranks)} rank(s) failed", rank_errors=ranks
            )

        session = comm.session(f"commit-{tag}")
        try:
            return bool(all_reduce(comm, session, tag, local, all, failed or lost))
        finally:
            session.close()

    def _landed(self, comm: Comm, landed: bool) -> bool:
        """(all ranks) Whether every node leader wrote its marker (the others say yes): one
        vote; a rank lost during it fails it."""

        def lost(ranks: RankErrors) -> TrainsnapError:
            return CommitFailedError(
                f"memory commit: {len(ranks)} rank(s) lost before every marker was known",
                rank_errors=ranks,
            )

        session = comm.session("commit-landed")
        try:
            return vote(comm, session, "landed", landed, lost)
        finally:
            session.close()

    def _replicate(
        self,
        sid: str,
        objects: Mapping[str, int],
        held: tuple[bytes, bytes] | None,
        hasher: Hasher,
    ) -> bytes | None:
        """Step 2 (all ranks): objects to partners, manifest and marker to every node; the
        marker a node leader received (None elsewhere)."""
        tier = self.tier
        assert tier.topology is not None
        topology, rank = tier.topology, tier.comm.rank
        if len(topology.ring) == 1:
            return None
        leaders = {topology.leader(n) for n in topology.ring}
        group = replication.checkpoint_data_group()
        out: dict[int, bytes] = {}
        if held is not None:
            manifest, marker = held
            packed = struct.pack("<Q", len(marker)) + marker + manifest
            out = {leader: packed for leader in leaders if leader != rank}
        coordinator = tier.comm.coordinator
        incoming = [coordinator] if rank in leaders and rank != coordinator else []
        received: bytes | None = None
        for packed in replication.swap(out, incoming, group, "the manifest").values():
            (length,) = struct.unpack_from("<Q", packed)
            marker_bytes, manifest_bytes = packed[8 : 8 + length], packed[8 + length :]
            check_manifest_bytes(decode_marker(marker_bytes, sid), manifest_bytes)
            tier.storage.put(manifest_key(sid), manifest_bytes)
            received = marker_bytes
        ordered = sorted(objects.items())
        listing = json.dumps(ordered).encode()
        targets, sources = topology.targets(rank), topology.sources(rank)
        heard = replication.swap(dict.fromkeys(targets, listing), sources, group, "object lists")
        offered = {s: [(str(n), int(z)) for n, z in json.loads(heard[s])] for s in sources}
        lacks = {s: bytes(not tier.has(n, z) for n, z in offered[s]) for s in sources}
        answers = replication.swap(lacks, targets, group, "missing objects")
        transfers = [
            replication.Transfer(n, z, rank, t)
            for t in targets
            for (n, z), lacking in zip(ordered, answers[t], strict=True)
            if lacking
        ]
        transfers += [
            replication.Transfer(n, z, s, rank)
            for s in sources
            for (n, z), lacking in zip(offered[s], lacks[s], strict=True)
            if lacking
        ]
        faults.point("replicate_objects")
        failed, _ = replication.move(transfers, rank, group, tier.read, tier.write, hasher)
        if failed:
            raise CommitFailedError(
                f"memory snapshot {sid}: {len(failed)} object copies failed (e.g. {failed[0]})",
                snapshot_id=sid,
            )
        return received
