"""The memory tier's saves: each node's ranks write to the node's tmpfs, copies go to partner
nodes over the checkpoint-data group, and only then is the snapshot committed there.

A memory save, on every rank (the steps after staging on the save's background thread):

1. (all ranks) the ordinary save protocol, through a :class:`~trainsnap.manager.memory_route.
   SaveRoute`: objects to this node's directory, reports over the control plane, and the
   coordinator's manifest and marker held back. Training resumes once the state is staged.
2. (all ranks) replication over the checkpoint-data group
   (:mod:`trainsnap.protocol.replication`): each rank tells the rank of the same local rank on
   each partner node which objects it wrote; that rank answers which it lacks; the objects go
   over, are checked against their content address and written into the partner's directory.
   The coordinator sends the manifest and the final marker to one rank of every other node,
   which checks the manifest against the marker and writes the manifest.
3. (coordinator) one all-reduce of success on the control plane: any failure anywhere (a
   partner lost mid-copy, a copy that does not verify, a timeout) and no node gets a marker;
   the error is raised by the next memory step, ``wait()`` or ``close()``.
4. (one rank per node) unless a newer writer generation took the node over, write the marker
   last (its ``writer`` says the job, the generation and the copies).
5. (all ranks) say whether their node's marker landed; the coordinator answers whether every
   one did. If so, each node applies its retention (``keep`` snapshots, and those waiting for
   promotion) and collects; if not (a full tmpfs), the markers that landed are taken back and
   every rank raises: a snapshot is committed on every node or on none, as the save reports
   (a crash inside this step can leave it on some nodes: a restore repairs the others' markers
   from them). The coordinator decides the next memory save only once every rank finished this
   one, so no save's collection can race another save's writes.

Memory saves are decided by the coordinator at each memory step, the same on every rank: a save
still in flight there means this step's memory save is skipped (counted, logged) unless
``MemoryTier(wait_if_busy=True)``; a durable step always waits and saves. Every operation of a
rank on the checkpoint-data group runs on its one memory-save thread, one save at a time, in the
same order on every rank.

Durable saves promote the memory snapshot of their step
(:class:`~trainsnap.manager.memory_promotion.Promoter`).
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import struct
import threading
from dataclasses import replace
from typing import Any

from trainsnap import faults
from trainsnap.engine.staging import StagingPool
from trainsnap.errors import CommitFailedError, InvalidArgumentError, TrainsnapError
from trainsnap.format.checksums import Hasher
from trainsnap.format.manifest import manifest_key, marker_key, object_key
from trainsnap.format.marker import check_manifest_bytes, decode_marker
from trainsnap.manager import collection
from trainsnap.manager.memory_nodes import (
    Topology,
    check_writer,
    gather_topology,
    job_of,
    node_directory,
    shortfall,
    take_over,
    this_node,
)
from trainsnap.manager.memory_promotion import Promoter
from trainsnap.manager.memory_route import SaveRoute
from trainsnap.manager.options import MemoryTier
from trainsnap.manager.placement import check_copies
from trainsnap.protocol import commit, replication
from trainsnap.protocol.collective import all_reduce
from trainsnap.protocol.control_plane import Comm, LocalComm, StoreComm
from trainsnap.protocol.rank_save import SaveRequest
from trainsnap.protocol.save_protocol import PendingSave, finish_save, prepare_save
from trainsnap.storage import open_storage
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)

_seq = itertools.count(1)
_KEEP_DECISIONS = 16


def _side_comm(comm: Comm, name: str) -> Comm:
    """A control plane of its own (own session numbering) for a thread of the memory tier."""
    if isinstance(comm, StoreComm):
        return StoreComm(
            comm.store,
            comm.rank,
            comm.world_size,
            coordinator=comm.coordinator,
            timeouts=comm.timeouts,
            namespace=name,
        )
    return LocalComm()


class MemorySaves:
    """One rank's memory tier: its node directory, its saves and promotions."""

    def __init__(self, options: MemoryTier, durable: Storage, comm: Comm, sync: bool) -> None:
        self.options = options
        self.durable = durable
        self.comm = comm
        self.sync = sync
        self.job = job_of(durable.url)
        self.node = this_node(options.node)
        self.directory = node_directory(options.root, self.job, self.node)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.storage: Storage = open_storage(str(self.directory))
        seq = next(_seq)
        self._prefix = f"trainsnap-memory-{seq}"
        self._save_comm = _side_comm(comm, f"{self._prefix}/save")
        self._promote_comm = _side_comm(comm, f"{self._prefix}/promote")
        self._store: Any = None
        """A store client of the memory tier's own (the training thread's decisions)."""
        if isinstance(comm, StoreComm):
            self._store = comm.store.clone() if hasattr(comm.store, "clone") else comm.store
        self.topology: Topology | None = None
        self.generation = 0
        self.present: set[str] = set()
        self.pool = StagingPool(None)
        self.skipped = 0
        """Memory steps whose save was skipped because the previous one was in flight."""
        self.saved = 0
        self.pause = 0.0
        """Seconds the newest memory save blocked the caller (capture, plan, staging)."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._decided = 0
        self._footprint_checked = False
        self.promoter = Promoter(self.storage, durable, self._promote_comm)
        self.newest: str | None = None

    # -- start ----------------------------------------------------------------------------------

    def start(self, generation: int | None) -> None:
        """(all ranks, once, before the first restore or save) learn the placement of every
        rank and the writer generation; take this node's directory over."""
        if self.topology is not None:
            return
        o = self.options
        self.topology, self.generation = gather_topology(
            self.comm, self.node, o.replicas, o.domains, generation
        )
        nodes = len(set(self.topology.nodes))
        check_copies(nodes, o.replicas, allow_fewer_copies=o.allow_fewer_copies)
        if self.is_leader:
            self.present = take_over(self.storage, self.job, self.generation)

    @property
    def is_leader(self) -> bool:
        assert self.topology is not None
        return self.topology.leader(self.node) == self.comm.rank

    # -- deciding -------------------------------------------------------------------------------

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def decide(self, force: bool) -> bool:
        """(all ranks, at each step the memory interval or a durable save names) whether this
        step takes a memory snapshot, the same on every rank (see the module docstring)."""
        go = force or not self.busy() or self.options.wait_if_busy
        if self._store is not None:
            key = f"{self._prefix}/go/{self._decided}"
            if self.comm.is_coordinator:
                self._store.set(key, b"1" if go else b"0")
                if self._decided >= _KEEP_DECISIONS:
                    self._store.delete_key(f"{self._prefix}/go/{self._decided - _KEEP_DECISIONS}")
            else:
                go = bytes(self._store.get(key)) == b"1"
            self._decided += 1
        if not go:
            self.skipped += 1
            log.info(
                "memory snapshot skipped: the previous one is still in flight (%d skipped so far)",
                self.skipped,
            )
        return go

    # -- saving ---------------------------------------------------------------------------------

    def save(self, tree: Any, opts: SaveRequest, promote: bool) -> None:
        """(all ranks, when :meth:`decide` said so) Stage the state and save it in the
        background (in the calling thread when the manager saves synchronously); raises the
        error of the previous memory save first."""
        self.wait()
        # content addresses are checked block by block on each copy
        opts.options = replace(opts.options, compression=None)
        namespace = f"{self._prefix}/reports/{opts.step}"
        route = SaveRoute(self.storage, self._store, namespace)
        pending = prepare_save(tree, route, opts, self.comm, pool=None if self.sync else self.pool)
        self.pause = pending.pause
        try:
            if not self._footprint_checked:
                self._check_footprint(pending)
        except BaseException:
            pending.session.close()
            if pending.lease is not None:
                self.pool.release(pending.lease)
            raise
        if self.sync:
            self._finish(pending, route, promote)
            self.raise_error()
            return
        self._thread = threading.Thread(
            target=self._finish,
            args=(pending, route, promote),
            name=f"trainsnap-memory-{opts.step}",
            daemon=True,
        )
        self._thread.start()

    def wait(self) -> None:
        """Wait for the memory save in flight; raise its error (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.raise_error()

    def raise_error(self) -> None:
        error, self._error = self._error, None
        error = error or self.promoter.take_error()
        if error is not None:
            raise error

    def _finish(self, pending: PendingSave, route: SaveRoute, promote: bool) -> None:
        sid = pending.snapshot_id
        try:
            try:
                finish_save(pending)
            finally:
                if pending.lease is not None:
                    self.pool.release(pending.lease)
            self._commit(sid, route, pending.hasher)
            self.saved += 1
            if promote:
                self.promoter.submit(sid, dict(route.objects))
        except BaseException as e:  # kept for the training thread
            log.error("memory snapshot %s was not committed: %s", sid, e)
            self._error = e

    def _commit(self, sid: str, route: SaveRoute, hasher: Hasher) -> None:
        """Steps 2 to 5 (module docstring)."""
        comm = self._save_comm
        manifest, marker = self._final_commit(sid, route)
        session = comm.session("commit")
        try:

            def replicate() -> None:
                try:
                    self._replicate(sid, route, manifest, marker, hasher)
                except OSError as e:  # a full tmpfs (ENOSPC): this rank's part failed, said so
                    raise CommitFailedError(
                        f"memory snapshot {sid}: writing a copy or the manifest into "
                        f"{self.storage.url} failed ({e}); check the free space there",
                        snapshot_id=sid,
                        path=str(self.storage.url),
                    ) from e
                if self.is_leader:  # a superseded writer fails the vote everywhere
                    check_writer(self.storage, self.generation)

            def failed(ranks: dict[int, str]) -> TrainsnapError:
                return CommitFailedError(
                    f"memory snapshot {sid} was not committed: {len(ranks)} rank(s) failed to "
                    "copy it to their partner nodes; the previous memory snapshot stays the newest",
                    snapshot_id=sid,
                    rank_errors=ranks,
                )

            all_reduce(comm, session, "replicated", replicate, lambda _: True, failed)
        finally:
            session.close()
        error: Exception | None = None
        if self.is_leader:
            try:
                if manifest is not None:  # the coordinator; the other leaders wrote theirs
                    self.storage.put(manifest_key(sid), manifest)
                self.storage.put(marker_key(sid), self._marker_bytes)
            except (TrainsnapError, OSError) as e:  # a full tmpfs is an OSError (ENOSPC)
                error = e
        if self._every_marker_landed(comm, error is None):
            if self.is_leader:
                self.newest = sid
                self._retain()
            return
        if self.is_leader and error is None:
            # Another node's marker failed: take this one back (marker first, as any delete),
            # so the snapshot is committed on every node or on none, as the save reports.
            self.storage.delete(marker_key(sid))
        raise CommitFailedError(
            f"memory snapshot {sid}: a node's marker could not be written"
            + (f" (this node's: {error})" if error is not None else "")
            + ", so the markers that landed were taken back: not committed, the previous memory "
            "snapshot stays the newest. Check the free space of the memory tier's directory on "
            "every node.",
            snapshot_id=sid,
        ) from error

    def _every_marker_landed(self, comm: Comm, landed: bool) -> bool:
        """(all ranks) Whether every node leader wrote its marker; ranks that are not leaders
        say True. Every rank waits here, whatever happened to its node's marker."""
        done = comm.session("done")
        try:
            said = done.gather("finished", landed)
            return bool(done.broadcast("outcome", None if said is None else all(said)))
        finally:
            done.close()

    def _final_commit(self, sid: str, route: SaveRoute) -> tuple[bytes | None, bytes | None]:
        """(coordinator) the manifest and the marker to write, with the marker's writer record."""
        if not self.comm.is_coordinator:
            return None, None
        assert self.topology is not None
        manifest = route.held[manifest_key(sid)]
        doc = json.loads(route.held[marker_key(sid)])
        doc["writer"] = {
            **doc.get("writer", {}),
            "tier": "memory",
            "copies": self.topology.copies,
            "job": self.job,
            "generation": self.generation,
        }
        marker = json.dumps(doc, separators=(",", ":")).encode()
        return manifest, marker

    _marker_bytes: bytes = b""

    def _replicate(
        self,
        sid: str,
        route: SaveRoute,
        manifest: bytes | None,
        marker: bytes | None,
        hasher: Hasher,
    ) -> None:
        """Step 2 (all ranks): objects to partners, manifest and marker to every node."""
        assert self.topology is not None
        topology, rank = self.topology, self.comm.rank
        leaders = {topology.leader(n) for n in topology.ring}
        if len(topology.ring) == 1:
            self._marker_bytes = marker or b""
            return
        group = replication.checkpoint_data_group()
        # The manifest and the marker, from the coordinator to the other nodes' leaders.
        out: dict[int, bytes] = {}
        if manifest is not None and marker is not None:
            packed = struct.pack("<Q", len(marker)) + marker + manifest
            out = {leader: packed for leader in leaders if leader != rank}
        coordinator = self.comm.coordinator
        incoming = [coordinator] if rank in leaders and rank != coordinator else []
        got = replication.swap(out, incoming, group, "the manifest")
        if self.comm.is_coordinator:
            self._marker_bytes = marker or b""
        for packed in got.values():
            (length,) = struct.unpack_from("<Q", packed)
            marker_bytes, manifest_bytes = packed[8 : 8 + length], packed[8 + length :]
            check_manifest_bytes(decode_marker(marker_bytes, sid), manifest_bytes)
            self.storage.put(manifest_key(sid), manifest_bytes)
            self._marker_bytes = marker_bytes
        # Which objects each rank wrote, to its partners; which of them they lack, back.
        objects = sorted(route.objects.items())
        listing = json.dumps(objects).encode()
        targets, sources = topology.targets(rank), topology.sources(rank)
        heard = replication.swap(dict.fromkeys(targets, listing), sources, group, "object lists")
        offered = {s: [(str(n), int(z)) for n, z in json.loads(heard[s])] for s in sources}
        lacks = {s: bytes(not self._has(n, z) for n, z in offered[s]) for s in sources}
        answers = replication.swap(lacks, targets, group, "missing objects")
        transfers = [
            replication.Transfer(n, z, rank, t)
            for t in targets
            for (n, z), lacking in zip(objects, answers[t], strict=True)
            if lacking
        ]
        transfers += [
            replication.Transfer(n, z, s, rank)
            for s in sources
            for (n, z), lacking in zip(offered[s], lacks[s], strict=True)
            if lacking
        ]
        faults.point("replicate_objects")
        failed, _ = replication.move(transfers, rank, group, self._read, self._write, hasher)
        if failed:
            raise CommitFailedError(
                f"memory snapshot {sid}: {len(failed)} object copies failed (e.g. {failed[0]})",
                snapshot_id=sid,
            )

    def _has(self, name: str, size: int) -> bool:
        try:
            return self.storage.stat(object_key(name)) == size
        except FileNotFoundError:
            return False

    def _read(self, name: str) -> bytes:
        return self.storage.get(object_key(name))

    def _write(self, name: str, data: memoryview) -> None:
        self.storage.put(object_key(name), data)

    # -- bounds ---------------------------------------------------------------------------------

    def _retain(self) -> None:
        """(node leader, no save in flight anywhere) keep the newest ``keep`` committed
        snapshots and those waiting for promotion; collect everything else. A failure is
        logged: it costs room, not a snapshot."""
        try:
            found = commit.list_committed(self.storage)
            pinned = self.promoter.pinned()
            doomed = [c for c in found[: -self.options.keep] if c.snapshot_id not in pinned]
            for c in doomed:
                commit.delete_snapshot(self.storage, c.snapshot_id)
            collection.collect(self.storage, grace=None)
        except (OSError, TrainsnapError) as e:
            log.warning("retention of the memory tier %s failed: %s", self.storage.url, e)

    def _check_footprint(self, pending: PendingSave) -> None:
        """(all ranks, before the first memory save writes anything) refuse, with the numbers,
        a memory tier whose tmpfs cannot hold ``keep + 1`` snapshots of this node's state and
        its partners' copies."""
        assert self.topology is not None
        local = pending.local
        mine = sum(local.entries[i][4] for i, _ in pending.assignment.entries)
        mine += sum(len(local.value_bytes[i]) for i, _ in pending.assignment.values)
        usage = shutil.disk_usage(self.directory)
        held = sum(p.stat().st_size for p in self.directory.rglob("*") if p.is_file())
        session = self.comm.session("memory-footprint")
        try:
            said = session.gather("bytes", (mine, usage.free + held))
            verdict = None
            if said is not None:
                verdict = shortfall(self.topology, said, self.options.keep, str(self.directory))
            verdict = session.broadcast("verdict", verdict)
        finally:
            session.close()
        self._footprint_checked = True
        if verdict:
            raise InvalidArgumentError(verdict, path=str(self.directory))

    def drain(self) -> None:
        """Wait for the memory save in flight and every promotion queued; raise the first
        error of either."""
        self.wait()
        self.promoter.drain()
        self.raise_error()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.promoter.close()
