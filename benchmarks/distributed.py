"""Distributed save and load: trainsnap against torch.distributed.checkpoint on real gloo ranks,
a 4 -> 2 rank reshard, and a planner simulation at 4,096 ranks.

Three parts, all in one default run:

1. **Sharded save/load.** 4 spawned processes (gloo, file rendezvous, one intra-op thread each)
   on a (dp=2, tp=2) device mesh hold a DTensor state of ``--gib`` GiB (global, logical bytes):
   2-D weights placed [Replicate(), Shard(0)], [Replicate(), Shard(1)] and [Shard(0), Shard(1)],
   fp32 and bf16, plus small 1-D tensors (norms, biases). Each rank builds only its local shards
   (values are a deterministic function of the global coordinates), never a full tensor. Each
   repetition saves with both methods into fresh directories, then loads both into zeroed
   destination DTensors, the order of methods alternating between repetitions; the page cache is
   evicted (``posix_fadvise(DONTNEED)`` on every file of the checkpoint) before each load. Every
   phase is timed on every rank between two barriers (rank 0 runs ``sync`` before them, so that
   no phase pays for earlier write-back) and the slowest rank's time is reported. ``--warmup``
   repetitions (default 1) run first and are not counted; the first repetition's loads are
   checked bit for bit.
2. **Reshard.** The last 4-rank checkpoints of part 1 are loaded on 2 ranks (mesh (2, 1): each
   rank holds the [Replicate(), Shard(d)] weights whole and half of the [Shard(0), Shard(1)]
   ones), alternating methods, evicted before each load, checked once.

   **The limit** of both loads (``raw`` in the output): after the loads of each repetition, the
   byte ranges of trainsnap's object files that this rank's ``ts.load`` reads (found with
   trainsnap's own load planner, merged, cut at 32 MiB) are read again, evicted first, with
   ``preadv`` into one preallocated buffer on the same number of threads, with no checksums and
   no placement: what the disk and the page cache allow for the same bytes on the same ranks.
3. **Planner simulation** (no processes, no data): the descriptions of 4,096 ranks (TP 8 x PP 16
   x DP 32) of a ~185 B-parameter model (20,000 2-D bf16 parameters, TP-sharded, replicated over
   DP; fp32 Adam moments held ZeRO-1 style, each DP rank owning whole TP-local parameters) are
   planned (``plan_save``), every rank's write report is simulated, and the manifest is
   assembled, encoded and decoded.

Methods:

- ``trainsnap``: ``trainsnap.save`` (checksums on, the default) / ``trainsnap.load``, every rank
  calling them with its part of the state.
- ``dcp``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter(thread_count=<io
  threads>, sync_files=True)`` / ``dcp.load`` with ``FileSystemReader``, on the default group.

<io threads> is trainsnap's ``io_threads`` tunable (``TRAINSNAP_IO_THREADS`` overrides it).

    python benchmarks/distributed.py                  # 1 GiB, 1 warm-up + 3 repetitions, all parts
    python benchmarks/distributed.py --gib 0.25 --reps 2 --json out.json
    python benchmarks/distributed.py --skip-io        # the planner simulation only

The ranks are spawned by the test harness (``tests/harness.py``). Checkpoints live in a temporary
directory under ``--dir`` (default: the system's temporary directory), removed at the end.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import os
import resource
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))  # the rank harness

import torch

import trainsnap as ts
from common import (
    GiB,
    MiB,
    emit,
    evict,
    format_table,
    gbps,
    kv,
    machine_info,
    median,
    resident_fraction,
    rotated,
    scratch_root,
    timed,
)
from trainsnap import tunables
from trainsnap.format import encoding
from trainsnap.format.checksums import Hasher
from trainsnap.format.layout import layout_objects
from trainsnap.format.regions import Box
from trainsnap.protocol import commit
from trainsnap.protocol.assemble import assemble
from trainsnap.protocol.planner import Entry, RankMeta, SavePlan, Value, plan_save
from trainsnap.protocol.rank_save import SaveRequest, WriteReport

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")

METHODS = ("trainsnap", "dcp")

# trainsnap time / DCP time, at most.
IO_TARGETS: dict[str, float] = {"save": 1.0, "load": 0.5, "reshard_load": 0.5}
PLAN_TARGET_S = 10.0
DECODE_TARGET_S = 1.0
BALANCE_SLACK = 0.10  # the busiest writer within 10% of the mean plus one shard


# == part 1 and 2: the state ======================================================================

PLACEMENTS = ("RS0", "RS1", "S0S1", "RR")
HIDDEN = 2048
LAYERS = 16


@dataclass(frozen=True, slots=True)
class Spec:
    """One tensor of the benchmark state: its global shape, dtype and placement on the mesh."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: str  # one of PLACEMENTS: [Replicate(), Shard(0)], ..., [Replicate(), Replicate()]
    seed: int

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def state_specs(gib: float) -> list[Spec]:
    """About ``gib`` GiB of global tensors: an embedding and an output head ([R, S0]), 16 layers
    of a column-parallel QKV ([R, S0], fp32), a row-parallel output projection ([R, S1], fp32), an
    MLP up projection sharded over both mesh dimensions ([S0, S1], bf16) and a row-parallel down
    projection ([R, S1], bf16), each layer with 7 small 1-D tensors (a [R, S0] bias, replicated
    norms and biases). Rows scale with ``gib``; rows are multiples of 8."""
    if gib <= 0:
        raise ValueError(f"gib must be positive, got {gib}")
    total = int(gib * GiB)
    h = HIDDEN
    out: list[tuple[str, tuple[int, ...], torch.dtype, str]] = []

    def rows(frac: float, dt: torch.dtype) -> int:
        r = int(frac * total) // (h * dt.itemsize)
        return max(8, r - r % 8)

    f32, bf16 = torch.float32, torch.bfloat16
    per_layer = 0.80 / LAYERS
    out.append(("embed.weight", (rows(0.12, f32), h), f32, "RS0"))
    for i in range(LAYERS):
        p = f"layers.{i}"
        qkv = rows(per_layer * 0.3, f32)
        out += [
            (f"{p}.norm1.weight", (h,), f32, "RR"),
            (f"{p}.norm1.bias", (h,), f32, "RR"),
            (f"{p}.attn.qkv.weight", (qkv, h), f32, "RS0"),
            (f"{p}.attn.qkv.bias", (qkv,), f32, "RS0"),
            (f"{p}.attn.out.weight", (rows(per_layer * 0.2, f32), h), f32, "RS1"),
            (f"{p}.attn.out.bias", (h,), f32, "RR"),
            (f"{p}.norm2.weight", (h,), f32, "RR"),
            (f"{p}.norm2.bias", (h,), f32, "RR"),
            (f"{p}.mlp.up.weight", (rows(per_layer * 0.3, bf16), h), bf16, "S0S1"),
            (f"{p}.mlp.down.weight", (rows(per_layer * 0.2, bf16), h), bf16, "RS1"),
            (f"{p}.mlp.down.bias", (h,), bf16, "RR"),
        ]
    out.append(("final_norm.weight", (h,), f32, "RR"))
    out.append(("lm_head.weight", (rows(0.08, bf16), h), bf16, "RS0"))
    return [Spec(k, s, dt, pl, i) for i, (k, s, dt, pl) in enumerate(out)]


def describe_specs(specs: list[Spec]) -> dict[str, Any]:
    by_placement: dict[str, int] = {p: 0 for p in PLACEMENTS}
    by_dtype: dict[str, int] = {}
    for s in specs:
        by_placement[s.placement] += s.nbytes
        d = str(s.dtype).removeprefix("torch.")
        by_dtype[d] = by_dtype.get(d, 0) + s.nbytes
    sizes = sorted((s.nbytes for s in specs), reverse=True)
    return {
        "tensors": len(specs),
        "bytes": sum(sizes),
        "under_64kib": sum(1 for n in sizes if n < 64 << 10),
        "largest_mib": [round(n / MiB, 1) for n in sizes[:3]],
        "bytes_by_placement": by_placement,
        "bytes_by_dtype": by_dtype,
    }


def _placements(name: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return {
        "RS0": [Replicate(), Shard(0)],
        "RS1": [Replicate(), Shard(1)],
        "S0S1": [Shard(0), Shard(1)],
        "RR": [Replicate(), Replicate()],
    }[name]


def expected_local(spec: Spec, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The values of the box ``offsets``/``sizes`` of the global tensor ``spec``, computed from
    the box alone: ``a[row] * b[col] + c[row]`` with seeded random vectors (a row or column out
    of place changes the bytes). Elementwise ops are exactly rounded, so any box of any
    topology yields the same bits for the same element."""
    g = torch.Generator().manual_seed(1_000_003 + spec.seed)
    rows = spec.shape[0]
    a = torch.randn(rows, generator=g)
    if len(spec.shape) == 1:
        return a[offsets[0] : offsets[0] + sizes[0]].to(spec.dtype)
    b = torch.randn(spec.shape[1], generator=g)
    c = torch.randn(rows, generator=g)
    r0, c0 = offsets
    nr, nc = sizes
    x = a[r0 : r0 + nr, None] * b[None, c0 : c0 + nc]
    x.add_(c[r0 : r0 + nr, None])
    return x if spec.dtype == torch.float32 else x.to(spec.dtype)


def _local_box(spec: Spec, mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(
        spec.shape, mesh, _placements(spec.placement)
    )
    return tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)


def build_state(specs: list[Spec], mesh: Any, *, fill: bool) -> dict[str, Any]:
    """This rank's DTensors: local shards built directly (values, or zeros for destinations)."""
    from torch.distributed.tensor import DTensor

    state: dict[str, Any] = {}
    for s in specs:
        offsets, sizes = _local_box(s, mesh)
        local = expected_local(s, offsets, sizes) if fill else torch.zeros(sizes, dtype=s.dtype)
        strides = [1] * len(s.shape)
        for i in range(len(s.shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * s.shape[i + 1]
        state[s.key] = DTensor.from_local(
            local,
            mesh,
            _placements(s.placement),
            run_check=False,
            shape=torch.Size(s.shape),
            stride=tuple(strides),
        )
    return state


def local_nbytes(state: dict[str, Any]) -> int:
    return sum(t.to_local().nbytes for t in state.values())


def clear(state: dict[str, Any]) -> None:
    for t in state.values():
        t.to_local().zero_()


def check_state(specs: list[Spec], state: dict[str, Any], mesh: Any, what: str) -> int:
    """Bitwise comparison of every local shard with its expected values; returns bytes checked."""
    bad = []
    n = 0
    for s in specs:
        got = state[s.key].to_local()
        want = expected_local(s, *_local_box(s, mesh))
        if got.shape != want.shape or got.dtype != want.dtype:
            bad.append(f"{s.key}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}")
        elif not torch.equal(
            got.contiguous().reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
        ):
            bad.append(f"{s.key}: bytes differ")
        n += got.nbytes
    if bad:
        raise AssertionError(f"{what}: {len(bad)} tensor(s) wrong, e.g. {bad[:5]}")
    return n


# == part 1 and 2: the methods and the ranks =======================================================


def _save(method: str, state: dict[str, Any], d: Path, threads: int) -> None:
    if method == "trainsnap":
        ts.save(state, d, step=1)
    else:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(d, thread_count=threads, sync_files=True)
        dcp.save(state, storage_writer=writer)


def _load(method: str, state: dict[str, Any], d: Path) -> None:
    if method == "trainsnap":
        ts.load(state, d)
    else:
        import torch.distributed.checkpoint as dcp

        dcp.load(state, storage_reader=dcp.FileSystemReader(d))


def _raw_plan(
    d: Path, dst: dict[str, Any], rank: int, same_world: bool
) -> list[tuple[str, int, int]]:
    """The limit of a load: the byte ranges of the snapshot's object files that this rank's
    ``ts.load`` of ``dst`` reads (found with trainsnap's own load planner), merged per object and
    cut at 32 MiB, as (path, offset, length)."""
    from trainsnap.engine.reader import Reader
    from trainsnap.format.manifest import object_key
    from trainsnap.protocol import rank_load
    from trainsnap.state.capture import targets

    storage = ts.open_storage(d)
    (info,) = ts.list_snapshots(storage)
    m = commit.open_snapshot(storage, info.id)
    reader = Reader(storage, m)
    spans: dict[int, list[tuple[int, int]]] = {}
    indexes: dict[int, Any] = {}
    for dest, ti in rank_load.match(m, targets(dst), rank, same_world):
        for shard, pieces in rank_load._overlaps(m, ti, dest.item.region, indexes):
            for piece in pieces:
                lo, hi = piece.src_span()
                for o, oo, _, n in reader.payload_runs(
                    shard, lo * dest.itemsize, hi * dest.itemsize
                ):
                    spans.setdefault(o, []).append((oo, oo + n))
    plan = []
    for o, rs in spans.items():
        path = str(d / object_key(m.object_names[o]))
        rs.sort()
        merged = [list(rs[0])]
        for a, z in rs[1:]:
            if a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], z)
            else:
                merged.append([a, z])
        for a, z in merged:
            plan += [(path, x, min(z, x + RAW_PIECE) - x) for x in range(a, z, RAW_PIECE)]
    return plan


RAW_PIECE = 32 * MiB


def _raw_read(plan: list[tuple[str, int, int]], buf: memoryview, threads: int) -> None:
    """Read every range of ``plan`` into consecutive parts of ``buf`` (``preadv``, ``threads``
    threads, no verification, no placement)."""
    from concurrent.futures import ThreadPoolExecutor

    def read(job: tuple[str, int, int, int]) -> None:
        path, offset, length, at = job
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < length:
                n = os.preadv(fd, [buf[at + done : at + length]], offset + done)
                if n <= 0:
                    raise OSError(f"{path}: short read at {offset + done}")
                done += n
        finally:
            os.close(fd)

    jobs, at = [], 0
    for path, offset, length in plan:
        jobs.append((path, offset, length, at))
        at += length
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, jobs))


def _raw_phase(rank: int, d: Path, dst: dict[str, Any], same_world: bool, bufs: dict) -> float:
    """Evict, then time the raw reads of what this rank's load of ``d`` reads (``bufs`` keeps
    the destination buffer between repetitions, touched, as a load's destination is)."""
    plan = _raw_plan(d, dst, rank, same_world)
    size = sum(n for _, _, n in plan)
    if bufs.get("size", -1) < size:
        bufs["buf"] = memoryview(bytearray(size))  # zero-filled: every page touched
        bufs["size"] = size
    bufs["bytes"] = size
    _evict_for_load(rank, d)
    return _phase(lambda: _raw_read(plan, bufs["buf"], tunables.get().io_threads))


def _phase(fn: Callable[[], object]) -> float:
    """This rank's time for ``fn``, started together with every rank (barrier before) and
    followed by a barrier, so that phases never overlap. Rank 0 first flushes what earlier work
    left dirty (a removed checkpoint, directory entries), so that no phase pays for another's
    write-back."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os.sync()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    dist.barrier()
    return dt


def _mesh(dp: int, tp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _dir_bytes(d: Path) -> tuple[int, int]:
    files = [p for p in d.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _evict_for_load(rank: int, d: Path) -> float | None:
    """Rank 0 drops the checkpoint's files from the page cache (they are shared by all ranks of
    this machine) and returns the fraction of their pages still resident."""
    if rank != 0:
        return None
    evict(d)
    return resident_fraction(d)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def sharded_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Part 1, on each of the 4 ranks: every repetition (warm-up ones first) saves with both
    methods, then loads both (evicted first); the first repetition's loads are checked. The last
    repetition's checkpoints are kept (as ``<method>-last``) for the reshard."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    root = Path(cfg["root"])
    specs = state_specs(cfg["gib"])
    mesh = _mesh(2, 2)
    t0 = time.perf_counter()
    src = build_state(specs, mesh, fill=True)
    dst = build_state(specs, mesh, fill=False)
    build_s = time.perf_counter() - t0
    warmup, threads = cfg["warmup"], cfg["threads"]
    reps = warmup + cfg["reps"]
    save_s: dict[str, list[float]] = {m: [] for m in METHODS}
    load_s: dict[str, list[float]] = {m: [] for m in METHODS}
    resident: dict[str, list[float | None]] = {m: [] for m in METHODS}
    disk: dict[str, tuple[int, int]] = {}
    checked: dict[str, int] = {}
    raw_s: list[float] = []
    raw_bufs: dict[str, Any] = {}
    orders = []
    for rep in range(reps):
        order = rotated(METHODS, rep - warmup)  # the first timed repetition starts with trainsnap
        orders.append(order)
        dirs = {m: root / f"{m}-{rep}" for m in METHODS}
        if rank == 0:
            for d in dirs.values():
                d.mkdir(parents=True)
        for m in order:
            save_s[m].append(_phase(lambda m=m, d=dirs[m]: _save(m, src, d, threads)))
        for m in order:
            clear(dst)
            resident[m].append(_evict_for_load(rank, dirs[m]))
            load_s[m].append(_phase(lambda m=m, d=dirs[m]: _load(m, dst, d)))
            if rep == 0:
                checked[m] = check_state(specs, dst, mesh, f"{m} load, rank {rank}")
        raw_s.append(_raw_phase(rank, dirs["trainsnap"], dst, True, raw_bufs))
        dist.barrier()
        if rank == 0:
            for m, d in dirs.items():
                disk[m] = _dir_bytes(d)
                if rep == reps - 1:
                    d.rename(root / f"{m}-last")
                else:
                    shutil.rmtree(d)
        dist.barrier()
    return {
        "rank": rank,
        "local_bytes": local_nbytes(src),
        "build_s": build_s,
        "save_s": save_s,
        "load_s": load_s,
        "raw_load_s": raw_s,
        "raw_bytes": raw_bufs["bytes"],
        "resident_before_load": resident,
        "disk": disk,
        "checked_bytes": checked,
        "orders": orders,
        "peak_rss": _peak_rss(),
    }


def reshard_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Part 2, on each of the 2 ranks (mesh (2, 1)): load the 4-rank checkpoints of part 1,
    alternating methods (warm-up repetitions first), evicted first; the first repetition's loads
    are checked."""
    warnings.filterwarnings("ignore")
    root = Path(cfg["root"])
    specs = state_specs(cfg["gib"])
    mesh = _mesh(2, 1)
    dst = build_state(specs, mesh, fill=False)
    load_s: dict[str, list[float]] = {m: [] for m in METHODS}
    resident: dict[str, list[float | None]] = {m: [] for m in METHODS}
    checked: dict[str, int] = {}
    raw_s: list[float] = []
    raw_bufs: dict[str, Any] = {}
    orders = []
    for rep in range(cfg["warmup"] + cfg["reps"]):
        order = rotated(METHODS, rep - cfg["warmup"])
        orders.append(order)
        for m in order:
            d = root / f"{m}-last"
            clear(dst)
            resident[m].append(_evict_for_load(rank, d))
            load_s[m].append(_phase(lambda m=m, d=d: _load(m, dst, d)))
            if rep == 0:
                checked[m] = check_state(specs, dst, mesh, f"{m} resharded load, rank {rank}")
        raw_s.append(_raw_phase(rank, root / "trainsnap-last", dst, False, raw_bufs))
    return {
        "rank": rank,
        "local_bytes": local_nbytes(dst),
        "load_s": load_s,
        "raw_load_s": raw_s,
        "raw_bytes": raw_bufs["bytes"],
        "resident_before_load": resident,
        "checked_bytes": checked,
        "orders": orders,
        "peak_rss": _peak_rss(),
    }


def _slowest(per_rank: list[dict[str, Any]], field: str) -> dict[str, list[float]]:
    """Per method, per repetition: the slowest rank's time."""
    return {
        m: [max(r[field][m][i] for r in per_rank) for i in range(len(per_rank[0][field][m]))]
        for m in METHODS
    }


def _results(per_rank: list[dict[str, Any]], fields: tuple[str, ...], warmup: int) -> dict:
    """The slowest rank's times per phase, the warm-up repetitions apart."""
    out: dict[str, Any] = {"per_rank": per_rank}
    for f in fields:
        slow = _slowest(per_rank, f)
        out[f] = {m: xs[warmup:] for m, xs in slow.items()}
        out[f"warmup_{f}"] = {m: xs[:warmup] for m, xs in slow.items()}
    if "raw_load_s" in per_rank[0]:
        n = len(per_rank[0]["raw_load_s"])
        slow_raw = [max(r["raw_load_s"][i] for r in per_rank) for i in range(n)]
        out["raw_load_s"], out["warmup_raw_load_s"] = slow_raw[warmup:], slow_raw[:warmup]
        out["raw_bytes"] = [r["raw_bytes"] for r in per_rank]
    out["orders"] = per_rank[0]["orders"][warmup:]
    out["warmup_orders"] = per_rank[0]["orders"][:warmup]
    return out


def run_io(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    from trainsnap.testing import assert_all_ok, run_ranks

    specs = state_specs(args.gib)
    desc = describe_specs(specs)
    nbytes = desc["bytes"]
    root, free = scratch_root(args.dir, nbytes * 2.6, "trainsnap-dist-")
    print(f"state: {kv(desc)}")
    print(f"directory: {root} ({free / GiB:.0f} GiB free)", flush=True)
    reps = args.warmup + args.reps
    # Generous deadlines: 4 ranks share the cores; a hung run still ends.
    timeout = 900 + 900 * args.gib * reps
    cfg = {
        "root": str(root),
        "gib": args.gib,
        "reps": args.reps,
        "warmup": args.warmup,
        "threads": threads,
    }
    how = f"{args.warmup} warm-up + {args.reps} timed repetitions"
    out: dict[str, Any] = {"state": desc}
    try:
        print(f"part 1: 4 ranks, mesh (dp=2, tp=2), {how} ...", flush=True)
        wall, results = timed(lambda: run_ranks(sharded_rank, 4, args=(cfg,), timeout=timeout))
        per_rank = assert_all_ok(results)
        fields = ("save_s", "load_s")
        out["sharded"] = {
            "world": 4,
            "mesh": {"dp": 2, "tp": 2},
            **_results(per_rank, fields, args.warmup),
            "disk": per_rank[0]["disk"],
            "wall_s": wall,
        }
        _print_reps("part 1", out["sharded"], fields)
        if not args.skip_reshard:
            print(f"part 2: 2 ranks, mesh (dp=2, tp=1), {how} ...", flush=True)
            wall, results = timed(lambda: run_ranks(reshard_rank, 2, args=(cfg,), timeout=timeout))
            per_rank2 = assert_all_ok(results)
            out["reshard"] = {
                "world": 2,
                "mesh": {"dp": 2, "tp": 1},
                **_results(per_rank2, ("load_s",), args.warmup),
                "wall_s": wall,
            }
            _print_reps("part 2", out["reshard"], ("load_s",))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _print_reps(what: str, res: dict[str, Any], fields: tuple[str, ...]) -> None:
    rows = [("warm-up", "warmup_", i, o) for i, o in enumerate(res["warmup_orders"])]
    rows += [("rep", "", i, o) for i, o in enumerate(res["orders"])]
    for label, prefix, i, order in rows:
        parts = []
        for m in METHODS:
            parts.append(m + " " + "/".join(f"{res[prefix + f][m][i]:.2f}" for f in fields) + "s")
        print(f"  {what} {label} {i + 1} [{' '.join(order)}] " + "  ".join(parts), flush=True)


# == part 3: the planner at 4,096 ranks ===========================================================

TP, PP, DP = 8, 16, 32
PARAMS_PER_STAGE = 1250
# One "layer" of 10 parameters (hidden 4096, 4 experts): (name, global shape, TP-sharded dim).
# Half are sharded on dim 0 (column parallel), half on dim 1 (row parallel).
LAYER: tuple[tuple[str, tuple[int, int], int], ...] = (
    ("attn.qkv.weight", (6144, 4096), 0),
    ("attn.out.weight", (4096, 4096), 1),
    *(
        (f"mlp.experts.{e}.{w}", shape, dim)
        for e in range(4)
        for w, shape, dim in (("w1", (1536, 4096), 0), ("w2", (4096, 1536), 1))
    ),
)
RNG_STATE_BYTES = 5056  # a per-rank value (each rank's RNG state differs)
SIM_CHUNK = 32 * MiB
SIM_BLOCK = 1 * MiB


def sim_rank(pp: int, dp: int, tp: int) -> int:
    """Megatron's order: TP fastest, then DP, then PP."""
    return (pp * DP + dp) * TP + tp


def sim_model(pp: int, tp: int) -> list[Entry]:
    """The TP-local parameter entries of one (pp, tp): identical on its 32 DP replicas."""
    out: list[Entry] = []
    per_layer = len(LAYER)
    for j in range(PARAMS_PER_STAGE):
        layer = pp * (PARAMS_PER_STAGE // per_layer) + j // per_layer
        name, shape, dim = LAYER[j % per_layer]
        part = shape[dim] // TP
        sizes = (part, shape[1]) if dim == 0 else (shape[0], part)
        offsets = (tp * part, 0) if dim == 0 else (0, tp * part)
        key = f"model.layers.{layer}.{name}"
        out.append((key, "bfloat16", shape, Box(offsets, sizes), sizes[0] * sizes[1] * 2, None))
    return out


def zero1_cuts(numels: list[int], parts: int) -> list[int]:
    """Cut the flat buffer of ``numels`` into ``parts`` contiguous ranges at parameter
    boundaries, each cut at the first boundary at or past its even share. Returns parts + 1
    indices."""
    cum = [0]
    for n in numels:
        cum.append(cum[-1] + n)
    total = cum[-1]
    cuts = [min(bisect.bisect_left(cum, total * k / parts), len(numels)) for k in range(parts)]
    return [*cuts, len(numels)]


def sim_optim(model: list[Entry], dp: int, cuts: list[int]) -> list[Entry]:
    """This DP rank's ZeRO-1 slice of the two Adam moments: whole TP-local parameters, as boxes
    of the logical fp32 moment tensors."""
    out: list[Entry] = []
    for key, _dt, shape, region, nbytes, _d in model[cuts[dp] : cuts[dp + 1]]:
        for moment in ("exp_avg", "exp_avg_sq"):
            out.append((f"optim.{moment}.{key}", "float32", shape, region, nbytes * 2, None))
    return out


def sim_values(rank: int, hasher: Hasher) -> list[Value]:
    """A value every rank holds identically (stored once) and one per rank (its RNG state)."""
    step = b'{"step": 100000, "lr": 0.0003}'
    rng = rank.to_bytes(8, "little") * (RNG_STATE_BYTES // 8)
    assert len(rng) == RNG_STATE_BYTES
    return [
        ("train.schedule", "json", hasher.digest(step), len(step)),
        ("rng.state", "pickle", hasher.digest(rng), len(rng)),
    ]


def build_metas(hasher: Hasher) -> tuple[list[RankMeta], list[list[Entry]]]:
    """The 4,096 ranks' descriptions (each packed by RankMeta.pack as a rank would) and their
    flat entry lists (for the simulated writes)."""
    world = TP * PP * DP
    metas: list[RankMeta | None] = [None] * world
    flats: list[list[Entry] | None] = [None] * world
    for pp in range(PP):
        for tp in range(TP):
            model = sim_model(pp, tp)
            cuts = zero1_cuts([e[4] for e in model], DP)
            for dp in range(DP):
                r = sim_rank(pp, dp, tp)
                entries = model + sim_optim(model, dp, cuts)  # the same Entry objects
                metas[r] = RankMeta.pack(r, 100, entries, sim_values(r, hasher))
                flats[r] = entries
    assert all(m is not None for m in metas)
    return metas, flats  # type: ignore[return-value]


def simulate_reports(
    plan: SavePlan, metas: list[RankMeta], flats: list[list[Entry]]
) -> list[WriteReport]:
    """Each rank's report of writing its assignment: one object per 32 MiB chunk of each payload
    (small payloads packed), 32-hex-digit names unique per object, 16 bytes of digest per
    1 MiB block."""
    pattern = os.urandom(16 * (SIM_CHUNK // SIM_BLOCK))
    reports = []
    serial = 0
    for r, a in enumerate(plan.assignments):
        sizes = [flats[r][i][4] for i, _ in a.entries]
        sizes += [metas[r].values[i][3] for i, _ in a.values]
        layout = layout_objects(sizes, chunk_size=SIM_CHUNK, pack_threshold=SIM_BLOCK)
        objects = []
        for o in layout.objects:
            nblocks = -(-o.size // SIM_BLOCK)
            objects.append((f"{serial:032x}", o.size, pattern[: 16 * nblocks]))
            serial += 1
        n = len(a.entries)
        reports.append(
            WriteReport(
                objects=objects,
                entries=[(i, s, layout.chunks[j]) for j, (i, s) in enumerate(a.entries)],
                values=[(i, s, layout.chunks[n + j]) for j, (i, s) in enumerate(a.values)],
                bytes_new=sum(sizes),
            )
        )
    return reports


def run_sim() -> dict[str, Any]:
    world = TP * PP * DP
    hasher = Hasher()
    print(
        f"part 3: planner simulation, {world} ranks (TP {TP} x PP {PP} x DP {DP}), "
        f"{PP * PARAMS_PER_STAGE} parameters ...",
        flush=True,
    )
    gc.collect()
    build_s, (metas, flats) = timed(lambda: build_metas(hasher))
    params = PP * PARAMS_PER_STAGE // len(LAYER) * sum(s[0] * s[1] for _, s, _ in LAYER)
    meta_bytes = sum(len(b) for m in metas for _, b in m.groups)
    unique_blobs = len({b for m in metas for _, b in m.groups})
    print(f"  built {world} metas in {build_s:.2f} s ({meta_bytes / MiB:.0f} MiB of blobs)")
    sid = commit.new_snapshot_id(100)
    plan_s, plan = timed(lambda: plan_save(metas, sid))
    if plan.problems:
        raise AssertionError(f"the simulated plan was refused: {plan.problems[:5]}")
    print(f"  plan_save {plan_s:.2f} s", flush=True)
    sim_s, reports = timed(lambda: simulate_reports(plan, metas, flats))
    topology = {"world_size": world, "coordinator": 0, "mesh": {"pp": PP, "dp": DP, "tp": TP}}
    asm_s, manifest = timed(
        lambda: assemble(sid, SaveRequest(step=100), hasher, metas, plan, reports, topology)
    )
    print(f"  assemble {asm_s:.2f} s", flush=True)
    enc_s, data = timed(lambda: encoding.encode(manifest))
    dec_s, decoded = timed(lambda: encoding.decode(data))
    print(f"  manifest {len(data) / MiB:.1f} MiB, encode {enc_s:.2f} s, decode {dec_s:.2f} s")

    loads = plan.bytes_per_rank
    mean = sum(loads) / len(loads)
    largest = max(e[4] for f in flats for e in f)
    written = sum(loads)
    logical = int(decoded.nbytes)
    # Every byte is written once: the weights once for their 32 DP replicas, the two fp32
    # moments (4x the bf16 weights' bytes) by their owners, the shared value once, the per-rank
    # values by each rank.
    weights = sum(e[4] for pp in range(PP) for tp in range(TP) for e in sim_model(pp, tp))
    values = sim_values(0, hasher)
    expect = 5 * weights + values[0][3] + world * values[1][3]
    if written != expect:
        raise AssertionError(f"the plan writes {written} bytes, the state holds {expect}")
    return {
        "world": world,
        "tp": TP,
        "pp": PP,
        "dp": DP,
        "parameters": params,
        "logical_tensors": len(decoded.tensor_keys),
        "shards": len(decoded.shard_kind),
        "objects": len(decoded.object_names),
        "chunks": len(decoded.chunk_object),
        "bytes_written": written,
        "bytes_expected": expect,
        "manifest_nbytes": logical,
        "meta_blob_bytes": meta_bytes,
        "unique_blobs": unique_blobs,
        "build_metas_s": build_s,
        "plan_s": plan_s,
        "simulate_reports_s": sim_s,
        "assemble_s": asm_s,
        "encode_s": enc_s,
        "decode_s": dec_s,
        "manifest_bytes": len(data),
        "balance": {
            "max": max(loads),
            "mean": mean,
            "min": min(loads),
            "largest_shard": largest,
            "max_over_mean": max(loads) / mean,
            "excess_over_largest_shard": (max(loads) - mean) / largest,
            "ok": max(loads) <= (1 + BALANCE_SLACK) * mean + largest,
        },
    }


# == the report ====================================================================================


def _loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages: well above this run's own processes means that
    something else shared the machine."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def summarize(out: dict[str, Any]) -> None:
    """Medians and ratios of the I/O parts, into ``out["io_summary"]``."""
    s: dict[str, Any] = {}
    nbytes = out["io"]["state"]["bytes"]
    sh = out["io"].get("sharded")
    if sh:
        for m in METHODS:
            s[f"save/{m}"] = median(sh["save_s"][m])
            s[f"load/{m}"] = median(sh["load_s"][m])
        s["load/raw"] = median(sh["raw_load_s"])
    rs = out["io"].get("reshard")
    if rs:
        for m in METHODS:
            s[f"reshard_load/{m}"] = median(rs["load_s"][m])
        s["reshard_load/raw"] = median(rs["raw_load_s"])
    ratios = {}
    for op in IO_TARGETS:
        if f"{op}/trainsnap" in s:
            ratios[op] = s[f"{op}/trainsnap"] / s[f"{op}/dcp"]
        if f"{op}/raw" in s:
            ratios[f"{op}_vs_raw"] = s[f"{op}/trainsnap"] / s[f"{op}/raw"]
            ratios[f"{op}_dcp_vs_raw"] = s[f"{op}/dcp"] / s[f"{op}/raw"]
    speeds = {k: gbps(nbytes, v) for k, v in s.items()}
    out["io_summary"] = {"medians_s": s, "ratios": ratios, "GBps": speeds}


def _times(xs: list[float]) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


def _mib_list(xs: list[int]) -> str:
    return "[" + ", ".join(f"{x / MiB:.0f}" for x in xs) + "] MiB"


def _checked(per_rank: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"{m} {sum(r['checked_bytes'][m] for r in per_rank) / MiB:.0f} MiB" for m in METHODS
    )


def _check_row(name: str, value: float, target: str, ok: bool) -> list[object]:
    return [name, value, target, _verdict(ok)]


def _report_io(out: dict[str, Any], checks: list[list[object]]) -> list[str]:
    io, summ, cfg = out["io"], out["io_summary"], out["config"]
    med, ratios = summ["medians_s"], summ["ratios"]
    nbytes = io["state"]["bytes"]
    sh = io["sharded"]
    lines = [
        f"== part 1: sharded save/load, 4 ranks (dp=2, tp=2), state {nbytes / GiB:.3f} GiB "
        f"global ({io['state']['tensors']} tensors), {cfg['reps']} timed repetitions after "
        f"{cfg['warmup']} warm-up, "
        f"io_threads={cfg['io_threads']}, page cache evicted before loads; time of the slowest "
        "rank per phase",
    ]
    rows = []
    for m in METHODS:
        files, size = sh["disk"][m]
        save, load = med[f"save/{m}"], med[f"load/{m}"]
        rows.append([m, save, gbps(nbytes, save), load, gbps(nbytes, load), files, size / MiB])
    headers = ["method", "save s (median)", "save GB/s", "load s (median)", "load GB/s"]
    lines.append(format_table([*headers, "files", "MiB on disk"], rows))
    trows = []
    for m in METHODS:
        for op in ("save", "load"):
            f = f"{op}_s"
            trows.append([f"{m} {op}", _times(sh[f][m]), _times(sh[f"warmup_{f}"][m])])
    lines += ["", "individual times (s, slowest rank, in repetition order):"]
    lines.append(format_table(["phase", "times", "warm-up (not counted)"], trows))
    lines.append("orders: " + "; ".join(" ".join(o) for o in sh["orders"]))
    lines.append(_raw_line(sh, med["load/raw"], ratios, "load", cfg["io_threads"]))
    pr = sh["per_rank"]
    lines.append(
        f"local bytes per rank {_mib_list([r['local_bytes'] for r in pr])} (sources; the "
        f"destinations as much again); peak RSS per rank {_mib_list([r['peak_rss'] for r in pr])}"
        f", sum {sum(r['peak_rss'] for r in pr) / GiB:.2f} GiB"
    )
    lines.append(f"checked bitwise (first repetition, all ranks): {_checked(pr)}")
    res = [x for r in pr for v in r["resident_before_load"].values() for x in v if x is not None]
    if res:
        lines.append(f"page-cache residency of the files when loads started: max {max(res):.1%}")
    for op, label in (("save", "sharded save"), ("load", "sharded load")):
        t = IO_TARGETS[op]
        checks.append(
            _check_row(f"{label}: trainsnap/DCP", ratios[op], f"<= {t:g}", ratios[op] <= t)
        )
    rs = io.get("reshard")
    if rs:
        lines += [
            "",
            "== part 2: resharded load, the 4-rank (dp=2, tp=2) checkpoints of part 1 loaded on "
            "2 ranks (dp=2, tp=1)",
        ]
        rows = []
        for m in METHODS:
            t = med[f"reshard_load/{m}"]
            rows.append(
                [m, t, gbps(nbytes, t), _times(rs["load_s"][m]), _times(rs["warmup_load_s"][m])]
            )
        headers = ["method", "load s (median)", "load GB/s", "times (s)", "warm-up (s)"]
        lines.append(format_table(headers, rows))
        lines.append(
            _raw_line(rs, med["reshard_load/raw"], ratios, "reshard_load", cfg["io_threads"])
        )
        pr = rs["per_rank"]
        lines.append(
            f"local bytes per rank {_mib_list([r['local_bytes'] for r in pr])}; peak RSS per rank "
            f"{_mib_list([r['peak_rss'] for r in pr])}; checked bitwise: {_checked(pr)}"
        )
        t = IO_TARGETS["reshard_load"]
        r = ratios["reshard_load"]
        checks.append(_check_row("resharded load: trainsnap/DCP", r, f"<= {t:g}", r <= t))
    for op, label in (("load", "sharded load"), ("reshard_load", "resharded load")):
        if f"{op}_vs_raw" in ratios:
            checks.append([f"{label}: trainsnap/raw reads", ratios[f"{op}_vs_raw"], "-", "-"])
            checks.append([f"{label}: DCP/raw reads", ratios[f"{op}_dcp_vs_raw"], "-", "-"])
    return lines


def _raw_line(res: dict[str, Any], t: float, ratios: dict[str, float], op: str, th: int) -> str:
    return (
        f"limit: raw reads of the byte ranges each rank's trainsnap load reads (preadv, {th} "
        f"threads, no checks, no placement; {_mib_list(res['raw_bytes'])} per rank): median "
        f"{t:.3f} s ({_times(res['raw_load_s'])}); trainsnap/raw {ratios[f'{op}_vs_raw']:.2f}, "
        f"DCP/raw {ratios[f'{op}_dcp_vs_raw']:.2f}"
    )


def _report_sim(sim: dict[str, Any], checks: list[list[object]]) -> list[str]:
    b = sim["balance"]
    lines = [
        f"== part 3: planner simulation, {sim['world']} ranks (TP {sim['tp']} x PP {sim['pp']} "
        f"x DP {sim['dp']}), {sim['parameters'] / 1e9:.1f} B parameters, "
        f"{sim['logical_tensors']} logical tensors, {sim['shards']} shards, {sim['objects']} "
        f"objects, {sim['manifest_nbytes'] / 1e12:.2f} TB; rank descriptions "
        f"{sim['meta_blob_bytes'] / MiB:.0f} MiB of blobs, {sim['unique_blobs']} distinct",
    ]
    plan_ok = sim["plan_s"] < PLAN_TARGET_S
    decode_ok = sim["decode_s"] < DECODE_TARGET_S
    bound = (1 + BALANCE_SLACK) * b["mean"] + b["largest_shard"]
    rows = [
        ["build 4,096 RankMetas (not planning)", f"{sim['build_metas_s']:.2f} s", "-", "-"],
        ["plan_save", f"{sim['plan_s']:.2f} s", f"< {PLAN_TARGET_S:g} s", _verdict(plan_ok)],
        ["simulate write reports (not planning)", f"{sim['simulate_reports_s']:.2f} s", "-", "-"],
        ["assemble", f"{sim['assemble_s']:.2f} s", "-", "-"],
        ["encoding.encode", f"{sim['encode_s']:.2f} s", "-", "-"],
        ["manifest size", f"{sim['manifest_bytes'] / MiB:.1f} MiB", "-", "-"],
        [
            "encoding.decode",
            f"{sim['decode_s']:.2f} s",
            f"< {DECODE_TARGET_S:g} s",
            _verdict(decode_ok),
        ],
        ["writer bytes: max / mean", f"{b['max_over_mean']:.4f}", "-", "-"],
        [
            "writer bytes: (max - mean) / largest shard",
            f"{b['excess_over_largest_shard']:.3f}",
            "-",
            "-",
        ],
        [
            "writer bytes: max",
            f"{b['max'] / MiB:.1f} MiB",
            f"<= {1 + BALANCE_SLACK:g} x mean + 1 shard = {bound / MiB:.1f} MiB",
            _verdict(b["ok"]),
        ],
        ["writer bytes: mean, min", f"{b['mean'] / MiB:.1f}, {b['min'] / MiB:.1f} MiB", "-", "-"],
        ["largest single shard", f"{b['largest_shard'] / MiB:.1f} MiB", "-", "-"],
    ]
    lines.append(format_table(["step", "value", "target", "result"], rows))
    checks.append(
        _check_row("4,096-rank plan_save (s)", sim["plan_s"], f"< {PLAN_TARGET_S:g}", plan_ok)
    )
    checks.append(
        _check_row(
            "4,096-rank manifest decode (s)", sim["decode_s"], f"< {DECODE_TARGET_S:g}", decode_ok
        )
    )
    checks.append(
        _check_row(
            "writer balance: max / (1.1 x mean + 1 shard)", b["max"] / bound, "<= 1", b["ok"]
        )
    )
    return lines


def report(out: dict[str, Any]) -> str:
    lines: list[str] = [""]
    checks: list[list[object]] = []
    if "io_summary" in out:
        lines += [*_report_io(out, checks), ""]
    if "sim" in out:
        lines += [*_report_sim(out["sim"], checks), ""]
    if checks:
        lines.append("== targets")
        lines.append(format_table(["check", "value", "target", "result"], checks, digits=3))
    if out.get("loadavg"):
        shown = "; ".join(f"{k} {' '.join(map(str, v))}" for k, v in out["loadavg"].items())
        lines.append(
            f"\nload average (1/5/15 min): {shown}; {os.cpu_count()} CPUs. A high value at the "
            "start means other work shared the machine (later values count this run's own "
            "ranks and I/O threads too)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="global state size in GiB (default 1)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed repetitions first, both methods (default 1; 0 for none)",
    )
    p.add_argument(
        "--dir", default=None, help="where to write (default: the system's temporary directory)"
    )
    p.add_argument("--skip-io", action="store_true", help="skip parts 1 and 2 (real ranks)")
    p.add_argument("--skip-reshard", action="store_true", help="skip part 2 (the reshard)")
    p.add_argument("--skip-sim", action="store_true", help="skip part 3 (planner simulation)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.skip_io and args.skip_sim:
        p.error("nothing to run: --skip-io and --skip-sim together")

    threads = tunables.get().io_threads
    machine = machine_info()
    machine["trainsnap"] = ts.__version__
    machine["io_threads"] = threads
    print(f"machine: {kv(machine)}", flush=True)
    out: dict[str, Any] = {
        "machine": machine,
        "config": {
            "gib": args.gib,
            "reps": args.reps,
            "warmup": args.warmup,
            "io_threads": threads,
        },
        "targets": {
            "trainsnap/dcp": IO_TARGETS,
            "plan_s": PLAN_TARGET_S,
            "decode_s": DECODE_TARGET_S,
            "balance_slack": BALANCE_SLACK,
        },
    }
    loadavg: dict[str, list[float]] = {"start": _loadavg()}
    if not args.skip_io:
        out["io"] = run_io(args, threads)
        summarize(out)
        loadavg["after parts 1-2"] = _loadavg()
    if not args.skip_sim:
        out["sim"] = run_sim()
        loadavg["after part 3"] = _loadavg()
    out["loadavg"] = loadavg
    emit(out, report(out), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
