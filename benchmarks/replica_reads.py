"""Bytes a restore pulls from storage when ranks hold replicas: trainsnap sharing its replicas'
reads, trainsnap with each rank reading all it needs, and torch.distributed.checkpoint, on 4
gloo ranks.

Two layouts of the DTensor state of ``benchmarks.distributed``:

- ``ddp``: every tensor replicated on all 4 ranks (a data-parallel model: 4 replicas);
- ``mesh``: the (dp=2, tp=2) placements of ``benchmarks.distributed`` (2 replicas of most bytes).

Two stores, each with both layouts:

- ``file``: a local directory (``--gib`` GiB, global). What a rank pulls from storage is what its
  read syscalls return (``rchar`` of ``/proc/self/io``: it counts file reads, not the sockets the
  replicas exchange over); also reported, what it made the device read (``read_bytes``: a page
  already cached by another rank costs none). The ranks share one host and its page cache, so
  reading alone is cheap here: ``trainsnap`` (the default, sharing only where it helps) does
  not share on this store, ``trainsnap-shared`` is forced to.
- ``s3``: an object store, moto's S3 API on loopback (:class:`trainsnap.testing.s3.LoopbackS3`;
  ``--s3-gib`` GiB), which counts the body bytes it serves: every byte a rank pulls costs the
  store's time, as on a cluster's shared store. ``trainsnap`` (the default) shares here,
  ``trainsnap-alone`` reads all it needs on each rank (trainsnap before replicas shared), DCP
  loads through its ``FsspecReader``. moto copies a whole object to answer a ranged GET, so its
  time per request grows with the object, not only with the range.

Each layout is saved once by each method; then every repetition loads it with each method, in
an order rotating between repetitions (after ``--warmup`` uncounted ones: the first load of a
process also reads the modules it imports), into zeroed destinations, a local store's page cache
evicted first. Reported: the bytes pulled (summed over the ranks) / the bytes the method stored
(target <= 1.3 for the sharing trainsnap), the slowest rank's load time (median; between
barriers), and every load checked bit for bit in the first repetition. On the object store, the
sharing load must also be no slower than ``trainsnap-alone``.

    python -m benchmarks.replica_reads                 # 0.5 GiB file, 0.125 GiB s3, 3 repetitions
    python -m benchmarks.replica_reads --stores file   # the local store only
    python -m benchmarks.replica_reads --smoke         # tiny: does it run?
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import statistics
import uuid
from pathlib import Path
from typing import Any

from benchmarks._framework import cli
from benchmarks._framework.adapters import Dcp, Trainsnap
from benchmarks._framework.method import Method, rotated
from benchmarks._framework.report import Check, Target, emit, format_table, verdicts
from benchmarks._framework.sharded_state import (
    Spec,
    build_state,
    check_state,
    state_specs,
)
from benchmarks._framework.state import GiB
from benchmarks._framework.system import evict, iter_files, machine_info, scratch_root
from benchmarks.distributed import _barrier_timer
from trainsnap.testing import assert_all_ok, run_ranks, s3

WORLD = 4
TARGET = 1.3
"""trainsnap's bytes read summed over ranks / bytes stored, at most."""
SMOKE = {"gib": 0.01, "s3_gib": 0.01, "reps": 1}
SHARING = {"file": "trainsnap-shared", "s3": "trainsnap"}
"""Per store, the method whose loads share the replicas' reads."""


def _io() -> tuple[int, int]:
    """(bytes this process's read syscalls returned, bytes it made the device read)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ", 1) for line in f.read().splitlines())
    return int(fields["rchar"]), int(fields["read_bytes"])


def _specs(layout: str, gib: float) -> list[Spec]:
    specs = state_specs(gib)
    if layout == "ddp":
        return [dataclasses.replace(spec, placement="RR") for spec in specs]
    return specs


class _Reads(Trainsnap):
    """trainsnap, its loads with ``replica_reads`` set to ``mode`` (None: the default, 1)."""

    def __init__(
        self, name: str, mode: int | None, storage_options: dict[str, str] | None = None
    ) -> None:
        super().__init__(name=name, storage_options=storage_options)
        self.mode = mode

    def load(self, destination: Any, directory: Any) -> None:
        from trainsnap import tunables

        if self.mode is not None:
            mode = dataclasses.replace(tunables.get(), replica_reads=self.mode)
            tunables.set_for_testing(mode)
        try:
            super().load(destination, directory)
        finally:
            tunables.set_for_testing(None)


class _FsspecDcp(Dcp):
    """DCP through its ``FsspecWriter`` / ``FsspecReader`` (to an object store)."""

    def __init__(self, threads: int, storage_options: dict[str, str]) -> None:
        super().__init__(threads, distributed=True)
        self.storage_options = storage_options

    def _writer(self, directory: Any) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(
            directory, thread_count=self.threads, sync_files=False, **self.storage_options
        )

    def load(self, destination: Any, directory: Any) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(destination, storage_reader=FsspecReader(directory, **self.storage_options))


def _methods(store: str, storage_options: dict[str, str] | None = None) -> list[Method]:
    if store == "file":
        return [
            _Reads("trainsnap", None),
            _Reads("trainsnap-shared", 2),
            Dcp(8, distributed=True),
        ]
    assert storage_options is not None
    return [
        _Reads("trainsnap", None, storage_options),
        _Reads("trainsnap-alone", 0, storage_options),
        _FsspecDcp(8, storage_options),
    ]


def rank_main(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    """Save the layout with each method, then load it ``reps`` times with each."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    specs = _specs(config["layout"], config["gib"])
    store, root = config["store"], config["root"]
    methods = _methods(store, config.get("storage_options"))
    saved = {name: f"{root}/{name}" for name in ("trainsnap", "dcp")}
    for method in methods:
        if method.name in saved:
            _barrier_timer(
                lambda m=method: m.save(build_state(specs, mesh, fill=True), saved[m.name])
            )
    records: list[dict[str, Any]] = []
    for repetition in range(-config["warmup"], config["reps"]):
        for method in rotated(methods, repetition):
            directory = saved["dcp" if method.name == "dcp" else "trainsnap"]
            destination = build_state(specs, mesh, fill=False)
            if store == "file":
                _barrier_timer(lambda d=directory: evict(d) if rank == 0 else None)
            before = _pulled(config, rank)
            seconds = _barrier_timer(lambda m=method, d=directory, t=destination: m.load(t, d))
            after = _pulled(config, rank)
            read, device = after[0] - before[0], after[1] - before[1]
            if repetition == 0:
                check_state(specs, destination, mesh, f"{method.name} load")
            if repetition >= 0:
                records.append(
                    {"method": method.name, "seconds": seconds, "read": read, "device": device}
                )
    return {"records": records}


def _pulled(config: dict[str, Any], rank: int) -> tuple[int, int]:
    """What this rank counts of the bytes pulled so far: (read syscalls, device reads) of a
    file store; (the bytes the object store served, 0) on rank 0 of an object store, which
    counts for every rank (and (0, 0) on the others)."""
    if config["store"] == "file":
        return _io()
    return (s3.served(config["served_url"]) if rank == 0 else 0), 0


def _stored_file(directory: Path) -> int:
    return sum(path.stat().st_size for path in iter_files(directory))


def _stored_s3(endpoint: str, url: str) -> int:
    import boto3

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sum(obj["Size"] for page in pages for obj in page.get("Contents", []))


def run_layout(
    store: str, layout: str, args: Any, scratch: Path, server: s3.LoopbackS3 | None
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "store": store,
        "layout": layout,
        "gib": args.gib if store == "file" else args.s3_gib,
        "reps": args.reps,
        "warmup": args.warmup,
    }
    if server is None:
        directory = scratch / layout
        directory.mkdir()
        config["root"] = str(directory)
    else:
        config["root"] = server.url(f"{layout}-{uuid.uuid4().hex[:8]}")
        config["storage_options"] = server.options
        config["served_url"] = server.served_url
    per_rank = assert_all_ok(
        run_ranks(rank_main, WORLD, args=(config,), timeout=1800, rendezvous="tcp")
    )
    if server is None:
        stored = {name: _stored_file(directory / name) for name in ("trainsnap", "dcp")}
        shutil.rmtree(directory)
    else:
        stored = {
            name: _stored_s3(server.endpoint, f"{config['root']}/{name}")
            for name in ("trainsnap", "dcp")
        }
    out: dict[str, Any] = {}
    for name in [m.name for m in _methods(store, {})]:
        rows = [[r for r in rank["records"] if r["method"] == name] for rank in per_rank]
        reads = [sum(rank[i]["read"] for rank in rows) for i in range(args.reps)]
        device = [sum(rank[i]["device"] for rank in rows) for i in range(args.reps)]
        seconds = [max(rank[i]["seconds"] for rank in rows) for i in range(args.reps)]
        base = stored["dcp" if name == "dcp" else "trainsnap"]
        out[name] = {
            "stored": base,
            "read_ratio": statistics.median(reads) / base,
            "device_ratio": statistics.median(device) / base if store == "file" else None,
            "seconds": statistics.median(seconds),
            "all_seconds": seconds,
        }
    return out


def report(out: dict[str, Any]) -> tuple[str, list[Check]]:
    lines = [f"machine: {out['machine']}", f"{WORLD} gloo ranks"]
    checks: list[Check] = []
    for key, methods in out["layouts"].items():
        store, layout = key.split("/")
        pulled = "read calls / stored" if store == "file" else "served / stored"
        rows = [
            [
                name,
                m["stored"] / 2**20,
                m["read_ratio"],
                "-" if m["device_ratio"] is None else f"{m['device_ratio']:.3f}",
                m["seconds"],
                " ".join(f"{s:.3f}" for s in m["all_seconds"]),
            ]
            for name, m in methods.items()
        ]
        gib = out["gib"][store]
        lines += ["", f"{layout} on the {store} store ({gib} GiB global):"]
        header = ["method", "stored MiB", pulled, "device read / stored", "load s (median)"]
        lines.append(format_table([*header, "load s (each)"], rows))
        sharing = methods[SHARING[store]]
        other = methods["trainsnap" if store == "file" else "trainsnap-alone"]
        lines.append(
            f"  load time, {SHARING[store]} / {other_name(store)}: "
            f"{sharing['seconds'] / other['seconds']:.2f}; trainsnap / dcp: "
            f"{methods['trainsnap']['seconds'] / methods['dcp']['seconds']:.2f}"
        )
        name = f"{store} {layout}: {SHARING[store]} bytes pulled / stored"
        checks.append(Check(name, sharing["read_ratio"], Target("<=", TARGET)))
        if store == "s3":
            name = f"s3 {layout}: load time, sharing / each rank reading alone"
            checks.append(Check(name, sharing["seconds"] / other["seconds"], Target("<=", 1.0)))
    lines += ["", verdicts(checks)]
    return "\n".join(lines), checks


def other_name(store: str) -> str:
    return "trainsnap (default: this host does not share)" if store == "file" else "trainsnap-alone"


def main(argv: list[str] | None = None) -> int:
    arguments = cli.parser(__doc__, reps=3, seed=False)
    arguments.add_argument("--gib", type=float, default=0.5, help="file store's state (GiB)")
    arguments.add_argument("--s3-gib", type=float, default=0.125, help="s3 store's state (GiB)")
    arguments.add_argument(
        "--warmup", type=int, default=1, help="repetitions run first, not counted (default 1)"
    )
    arguments.add_argument("--layouts", default="ddp,mesh", help="comma-separated: ddp, mesh")
    arguments.add_argument("--stores", default="file,s3", help="comma-separated: file, s3")
    args = cli.parse(arguments, argv, SMOKE)
    stores = args.stores.split(",")
    gib = {"file": args.gib, "s3": args.s3_gib}
    out: dict[str, Any] = {"machine": machine_info(), "gib": gib, "layouts": {}}
    with scratch_root(args.dir, 3 * args.gib * GiB, "replica-reads-") as scratch:
        for store in stores:
            server = s3.LoopbackS3() if store == "s3" else contextlib.nullcontext()
            with server as running:
                for layout in args.layouts.split(","):
                    key = f"{store}/{layout}"
                    out["layouts"][key] = run_layout(store, layout, args, scratch, running)
    text, checks = report(out)
    emit(out, text, args.json)
    return 0 if args.smoke or all(check.result != "MISSED" for check in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
