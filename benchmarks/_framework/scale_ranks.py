"""The logical ranks of ``benchmarks.scale``: threads in a few worker processes, each rank a
client of one real ``TCPStore`` (through a :class:`~trainsnap.testing.counting_store.CountingStore`)
running the real save and load protocols (``run_save``, ``run_load``) on a tiny state whose
metadata is shaped like the planner simulation's model (:mod:`benchmarks.planner_sim`).

A worker takes commands from the parent over a pipe: ``(phase, step)`` runs that phase on
every rank of the worker at once (each on its own thread) and answers with one record per
rank and the worker's own figures. Not part of trainsnap.
"""

from __future__ import annotations

import os
import pickle
import re
import resource
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import numpy as np
import torch

import trainsnap as ts
from trainsnap import trace
from trainsnap.engine.gc_pause import paused_gc
from trainsnap.protocol import save_protocol
from trainsnap.protocol.control_plane import StoreComm, Timeouts
from trainsnap.protocol.load_protocol import run_load
from trainsnap.protocol.rank_save import SaveRequest
from trainsnap.storage.base import Buffer, Storage
from trainsnap.storage.posix import PosixStorage
from trainsnap.testing.counting_store import CountingStore

SHARD = 2
"""Each tensor shard is SHARD x SHARD elements: the metadata is the model's, the data tiny."""
STORE_TIMEOUT = timedelta(seconds=600)
# A rank is taken as dead after 600 s without a beat, not 60: hundreds of ranks share each core
# here, and a thread can wait that long for its turn at the interpreter lock. The beat is the
# default's (every 5 s), so the heartbeat counts are a real job's.
TIMEOUTS = Timeouts(heartbeat=600.0, beat_every=Timeouts().beat_interval)
SWITCH_INTERVAL = 0.05
"""Seconds a worker's thread holds the interpreter before it is asked to hand it over (Python's
default is 0.005): with a thousand ranks' threads in one process, the default's switching costs
more than the ranks' own work (a 1,024-rank metadata load: 57 s at 0.005, 29 s at 0.05, 492 s
at 0.0005); the ranks' CPU times below are their threads' own either way."""
SAMPLED = 4
"""Ranks of each worker whose load planning is timed again alone."""
MANIFEST_KEY = re.compile(r"^snapshots/[^/]+/manifest")
REPORT_KEY = re.compile(r"^snapshots/[^/]+/reports/")
MEMORY_EXIT = 86
"""A worker's exit status when it went past its memory limit."""


class ManifestCountingStorage:
    """A storage that counts the bytes read from manifest keys (``snapshots/*/manifest*``) and
    from the write reports stored for the coordinator (``snapshots/*/reports/*``)."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.readinto_is_zero_copy = inner.readinto_is_zero_copy
        self._lock = threading.Lock()
        self.manifest_bytes = 0
        self.manifest_reads = 0
        self.report_bytes = 0

    def _count(self, key: str, nbytes: int) -> None:
        if MANIFEST_KEY.match(key):
            with self._lock:
                self.manifest_bytes += nbytes
                self.manifest_reads += 1
        elif REPORT_KEY.match(key):
            with self._lock:
                self.report_bytes += nbytes

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        data = self.inner.get(key, start, end)
        self._count(key, len(data))
        return data

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        self.inner.read_into(key, start, out)
        self._count(key, out.nbytes)

    def put(self, key: str, data: Buffer | Any) -> None:
        self.inner.put(key, data)

    def stat(self, key: str) -> int:
        return self.inner.stat(key)

    def list(self, prefix: str) -> Any:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        return self.inner.put_if_absent(key, data)

    def mtime(self, key: str) -> float:
        return self.inner.mtime(key)

    def refresh(self, key: str, data: Buffer | Any) -> None:
        self.inner.refresh(key, data)


def rank_state(world: Any, rank: int, shared: dict[tuple[int, int], Any]) -> dict[str, Any]:
    """Rank ``rank``'s state: the planner simulation's entries (keys, dtypes, TP boxes, the
    ZeRO-1 moment slices of its DP rank) as ``ts.Sharded`` of SHARD x SHARD tensors, one
    value shared by every rank and one of its own. ``shared`` keeps the model part of each
    (pp, tp), the same on its DP replicas (and so the same tensors, as memory allows)."""
    from benchmarks.planner_sim import RNG_STATE_BYTES, sim_model, sim_optim, zero1_cuts

    tp, dp, pp = rank % world.tp, rank // world.tp % world.dp, rank // (world.tp * world.dp)
    if (pp, tp) not in shared:
        entries = sim_model(world, pp, tp)
        model = {
            key.split(".", 1)[1]: _tiny(shape, region, tp, world.tp, torch.bfloat16)
            for key, _, shape, region, *_ in entries
        }
        shared[pp, tp] = (entries, model, zero1_cuts([e[4] for e in entries], world.dp))
    entries, model, cuts = shared[pp, tp]
    optim = {
        key.split(".", 1)[1]: _tiny(shape, region, tp, world.tp, torch.float32)
        for key, _, shape, region, *_ in sim_optim(entries, dp, cuts)
    }
    # Top-level keys by pipeline stage and by the DP rank owning the moments: a tree load
    # restores the top-level keys a rank holds, all of what was saved under each.
    return {
        f"model_pp{pp}": model,
        f"optim_pp{pp}_dp{dp}": optim,
        "train": {"step": 100000, "lr": 3e-4},
        "rng": {"state": np.full(RNG_STATE_BYTES, rank % 251, dtype=np.uint8)},
    }


def _tiny(shape: tuple[int, int], region: Any, tp: int, tp_size: int, dtype: torch.dtype) -> Any:
    """A SHARD x SHARD shard at the same place in a shrunken tensor: the TP-sharded dimension
    is SHARD x TP long, the other SHARD."""
    dim = 0 if region.sizes[0] != shape[0] else 1
    global_shape = (SHARD * tp_size, SHARD) if dim == 0 else (SHARD, SHARD * tp_size)
    offsets = (SHARD * tp, 0) if dim == 0 else (0, SHARD * tp)
    local = torch.zeros(SHARD, SHARD, dtype=dtype)
    return ts.Sharded(local, global_shape=global_shape, offsets=offsets)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Worker:
    """The ranks ``ranks`` of one worker process."""

    def __init__(
        self,
        world: Any,
        ranks: range,
        host: str,
        port: int,
        root: str,
        memory_limit: int,
        load_data: bool = True,
    ) -> None:
        self.world, self.ranks = world, ranks
        self.memory_limit = memory_limit
        self.host, self.port = host, port
        self.storage = ManifestCountingStorage(PosixStorage(root))
        shared: dict[tuple[int, int], Any] = {}
        self.states = {r: rank_state(world, r, shared) for r in ranks}
        self.comms: dict[int, StoreComm] = {}
        self.thread_rank: dict[int, int] = {}
        self.plan_seconds: list[float] = []
        self.planning_cpu: dict[int, float] = {}
        others = [r for r in ranks if r != 0]
        self.sampled = set(others[:: max(1, len(others) // SAMPLED)][:SAMPLED])
        self.parts_of: dict[int, list[Any]] = {}
        trace.enable(rank=ranks.start)
        if 0 in ranks:
            self._time_coordinator_plan()
        self._time_load_planning()
        if not load_data:
            self._skip_tensor_reads()

    def _skip_tensor_reads(self) -> None:
        """Loads plan everything and read the values, but not the tensors' bytes: the
        metadata's part of a load alone (``--metadata-load``), for worlds whose data path --
        every rank reading, verifying and placing its ~1,300 tensors -- takes longer on a few
        cores than the metadata being measured."""
        from trainsnap.protocol import rank_load

        rank_load.load_tensors = lambda reader, pairs, threads: None  # type: ignore[assignment]

    def _time_coordinator_plan(self) -> None:
        """Time the coordinator's planning (``save_protocol._coordinator_plan``) apart from the
        waiting around it."""
        plan = save_protocol._coordinator_plan

        def timed_plan(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return plan(*args)
            finally:
                self.plan_seconds.append(time.perf_counter() - start)

        save_protocol._coordinator_plan = timed_plan  # type: ignore[assignment]

    def _time_load_planning(self) -> None:
        """Each rank's CPU time (its thread's) in the load's planning: getting its part of the
        manifest (wants, digest, unpickling; waiting costs no CPU), the tree plan and the
        match against its part -- not the reads."""
        from trainsnap.protocol import load_protocol, rank_load

        def timed(module: Any, name: str) -> None:
            function = getattr(module, name)

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                start = time.thread_time()
                try:
                    return function(*args, **kwargs)
                finally:
                    ident = threading.get_ident()
                    spent = time.thread_time() - start
                    self.planning_cpu[ident] = self.planning_cpu.get(ident, 0.0) + spent

            setattr(module, name, wrapper)

        timed(load_protocol.manifest_share, "manifest_for")
        timed(load_protocol.tree_load, "plan")
        timed(rank_load, "match")
        share = load_protocol.manifest_share
        merge = share.merge

        def recording_merge(parts: Any, *args: Any) -> Any:
            rank = self.thread_rank.get(threading.get_ident() % 1_000_000)
            if rank in self.sampled:
                self.parts_of[rank] = list(parts)
            return merge(parts, *args)

        share.merge = recording_merge  # type: ignore[assignment]

    def plan_alone(self, rank: int) -> float:
        """The CPU time of rank ``rank``'s load planning, run again after the load with no other
        rank running: unpickling its parts, its wants and their digests, the merge, the tree
        plan and the match (the same functions on the same data as in the load)."""
        from trainsnap.protocol import manifest_share, rank_load, tree_load
        from trainsnap.state.template import walk

        state = self.states[rank]
        blobs = [pickle.dumps(part) for part in self.parts_of.pop(rank)]
        start = time.thread_time()
        parts = [pickle.loads(blob) for blob in blobs]
        walked = walk(state)
        wants = manifest_share.wants_of(walked)
        assert wants is not None
        for wanted in manifest_share.classes_of(wants):
            manifest_share.digest_of(wanted)
        manifest = manifest_share.merge(parts)
        targets = tree_load.plan(walked, manifest, rank, True)
        rank_load.match(manifest, targets, rank, True)
        return time.thread_time() - start

    def run(self, phase: str, step: int) -> dict[str, Any]:
        """Run ``phase`` on every rank at once; a record per rank and the worker's figures."""
        records: dict[int, dict[str, Any]] = {}
        peak = [_rss()]
        start_rss = peak[0]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.05):
                peak[0] = max(peak[0], _rss())
                if peak[0] > self.memory_limit:  # the parent reports the phase as abandoned
                    os._exit(MEMORY_EXIT)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        before_manifest = self.storage.manifest_bytes
        before_reports = self.storage.report_bytes
        first_event = len(trace.events())
        threads = [
            threading.Thread(target=self._one, args=(phase, step, r, records), name=f"rank-{r}")
            for r in self.ranks
        ]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
        done.set()
        sampler.join()
        spans = self._spans(trace.events()[first_event:])
        for rank, record in records.items():
            record["spans"] = spans.get(rank, {})
        with paused_gc():
            for rank in sorted(set(self.parts_of) & set(records)):
                records[rank]["planning_alone_s"] = self.plan_alone(rank)
        return {
            "records": records,
            "wall_s": wall,
            "rss_start": start_rss,
            "rss_peak": peak[0],
            "manifest_bytes": self.storage.manifest_bytes - before_manifest,
            "report_bytes": self.storage.report_bytes - before_reports,
            "plan_s": list(self.plan_seconds),
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }

    def _spans(self, events: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
        out: dict[int, Counter[str]] = {}
        for event in events:
            rank = self.thread_rank.get(event["tid"])
            if rank is not None:
                out.setdefault(rank, Counter())[event["name"]] += event["dur"] / 1e6
        return {rank: dict(spans) for rank, spans in out.items()}

    def _one(self, phase: str, step: int, rank: int, records: dict[int, Any]) -> None:
        self.thread_rank[threading.get_ident() % 1_000_000] = rank
        cpu, wall = time.thread_time(), time.perf_counter()
        error = None
        counts = None
        try:
            if phase == "connect":
                client = CountingStore(self._connect())
                self.comms[rank] = StoreComm(client, rank, self.world.size, timeouts=TIMEOUTS)
            else:
                comm = self.comms[rank]
                counts = comm.store.counts.snapshot()
                self._protocol(phase, step, rank, comm)
        except Exception as e:  # a record, not a dead thread: the parent reports it
            error = f"{type(e).__name__}: {e}"
        after = self.comms[rank].store.counts.snapshot() if rank in self.comms else None
        records[rank] = {
            "error": error,
            "wall_s": time.perf_counter() - wall,
            "cpu_s": time.thread_time() - cpu,
            "planning_cpu_s": self.planning_cpu.pop(threading.get_ident(), 0.0),
            "counts": _delta(counts, after),
        }

    def _connect(self) -> Any:
        from torch.distributed import TCPStore

        return TCPStore(self.host, self.port, is_master=False, timeout=STORE_TIMEOUT)

    def _protocol(self, phase: str, step: int, rank: int, comm: StoreComm) -> None:
        state = self.states[rank]
        if phase == "save":
            save_protocol.run_save(state, self.storage, SaveRequest(step=step), comm)  # type: ignore[arg-type]
        elif phase == "change":  # the next save's values differ, its layout does not
            for part, value in state.items():
                if part.startswith("optim"):
                    for moment in value.values():
                        moment.local.add_(1)
            state["rng"]["state"] += 1
        elif phase == "load":
            with paused_gc():  # as trainsnap.load runs it
                run_load(
                    state,
                    self.storage,  # type: ignore[arg-type]
                    "latest",
                    comm,
                    level="strict",
                    allow_downgrade=True,
                    allow_pickle=False,
                )
        else:
            raise ValueError(f"unknown phase {phase!r}")


def _delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """Operations and bytes between two :meth:`StoreCounts.snapshot`, by thread kind."""
    if after is None:
        return {}
    before = before or {"ops": {}, "sent": {}, "received": {}}
    out: dict[str, Any] = {}
    for kind in ("exchange", "heartbeat"):
        ops_after, ops_before = after["ops"].get(kind, {}), before["ops"].get(kind, {})
        out[kind] = {
            "ops": sum(ops_after.values()) - sum(ops_before.values()),
            "adds": ops_after.get("add", 0) - ops_before.get("add", 0),
            "sent": after["sent"].get(kind, 0) - before["sent"].get(kind, 0),
            "received": after["received"].get(kind, 0) - before["received"].get(kind, 0),
        }
    tags_before = before.get("sent_by_tag", {})
    out["sent_by_tag"] = {
        tag: n - tags_before.get(tag, 0) for tag, n in after["sent_by_tag"].items()
    }
    return out


def serve(
    connection: Any,
    world: Any,
    ranks: range,
    host: str,
    port: int,
    root: str,
    memory_limit: int,
    load_data: bool = True,
) -> None:
    """A worker process's main loop: build the ranks, then run each command it is sent."""
    threading.stack_size(4 << 20)
    sys.setswitchinterval(SWITCH_INTERVAL)
    _raise_open_files()
    worker = Worker(world, ranks, host, port, root, memory_limit, load_data)
    connection.send("ready")
    while True:
        command = connection.recv()
        if command is None:
            break
        connection.send(worker.run(*command))
    for comm in worker.comms.values():
        del comm
    os._exit(0)  # the ranks' store clients need no orderly teardown


def _raise_open_files(need: int = 65536) -> None:
    """Three store connections a rank, on both ends: raise the limit on open files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = max(soft, need)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, max(hard, target)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
