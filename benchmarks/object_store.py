"""Save and load of one process's state on a real S3 server: trainsnap against DCP and the
store's limit, on SeaweedFS (:class:`trainsnap.testing.seaweedfs.SeaweedS3`) on loopback.

Each repetition saves the same state with every method (each under a fresh prefix), then loads
every method's snapshot into preallocated destinations, the order of the methods rotating from
one repetition to the next; each load is checked bit for bit against the source (outside the
timing). The server runs on this host: its own CPU time competes with the client's, as a
cluster's storage servers do not, so the figures compare methods, not stores.

Methods:

- ``trainsnap``: ``trainsnap.save`` (checksums on) / ``trainsnap.load`` on ``s3://``.
- ``dcp``: ``torch.distributed.checkpoint.save`` with its ``FsspecWriter(thread_count=<io
  threads>)`` / ``dcp.load`` with ``FsspecReader``, no process group.
- ``raw``: the same bytes, cut into pieces of trainsnap's ``chunk_size``, PUT by <io threads>
  threads through one s3fs client (trainsnap's) / GET back into the destinations the same way:
  no format and no hashing, the store's limit for this client.

    python -m benchmarks.object_store                 # 0.25 GiB, 3 repetitions
    python -m benchmarks.object_store --gib 0.1 --reps 5 --json out.json
    python -m benchmarks.object_store --smoke         # tiny: does it run and verify?
"""

from __future__ import annotations

import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks._framework import cli
from benchmarks._framework.adapters import Dcp, Trainsnap
from benchmarks._framework.method import Measurements, Method, SaveLoadRound, rotated, set_up
from benchmarks._framework.report import Ratio, compare, emit, facts
from benchmarks._framework.state import (
    GiB,
    Tensors,
    check_bitwise_equal,
    clear_state,
    describe_state,
    empty_like_state,
    make_state,
    tensor_view,
)
from benchmarks._framework.system import load_average, machine_info
from trainsnap import tunables
from trainsnap.storage import open_storage

SMOKE = {"gib": 0.01, "reps": 1}


class FsspecDcp(Dcp):
    """DCP through its ``FsspecWriter`` / ``FsspecReader``, single process."""

    def __init__(self, threads: int, storage_options: dict[str, str]) -> None:
        super().__init__(threads)
        self.storage_options = storage_options

    def _writer(self, directory: Any) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(
            directory, thread_count=self.threads, sync_files=False, **self.storage_options
        )

    def load(self, destination: Any, directory: Any) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader = FsspecReader(directory, **self.storage_options)
        dcp.load(destination, storage_reader=reader, **self._options(dcp.load))


class S3Raw(Method):
    """Parallel PUTs / GETs of the state's bytes through trainsnap's own s3fs client."""

    name = label = "raw"

    def __init__(self, threads: int, piece: int, storage_options: dict[str, str]) -> None:
        self.threads, self.piece = threads, piece
        self.storage_options = storage_options

    def _pieces(self, state: Tensors) -> list[tuple[str, memoryview]]:
        out = []
        for index, tensor in enumerate(state.values()):
            view = tensor_view(tensor)
            for start in range(0, len(view), self.piece):
                out.append((f"t{index}-{start}", view[start : start + self.piece]))
        return out

    def save(self, state: Tensors, directory: Any) -> None:
        storage = open_storage(str(directory), **self.storage_options)
        pieces = self._pieces(state)
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(lambda p: storage.put(p[0], p[1]), pieces))

    def load(self, destination: Tensors, directory: Any) -> None:
        storage = open_storage(str(directory), **self.storage_options)
        pieces = self._pieces(destination)
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(lambda p: storage.read_into(p[0], 0, p[1]), pieces))


def methods(threads: int, piece: int, options: dict[str, str]) -> list[Method]:
    return [
        Trainsnap(storage_options=options),
        FsspecDcp(threads, options),
        S3Raw(threads, piece, options),
    ]


def ratios() -> list[Ratio]:
    return [
        Ratio(f"{op}: trainsnap/{label}", ("trainsnap", op), (other, op))
        for op in ("save", "load")
        for other, label in (("dcp", "DCP"), ("raw", "raw"))
    ]


def repeat(
    compared: list[Method], state: Tensors, destination: Tensors, server: Any, args: Any
) -> Measurements:
    results = Measurements()
    for repetition in range(args.reps):

        def verify(method: Method, repetition: int = repetition) -> None:
            check_bitwise_equal(
                state, destination, f"{method.name} load, repetition {repetition + 1}"
            )

        one = SaveLoadRound(
            state=state,
            destination=destination,
            clear=clear_state,
            before_load=lambda _directory: None,
            verify=verify,
        )
        order = rotated(compared, repetition)
        prefixes = {m.name: server.url(f"{m.name}-{uuid.uuid4().hex[:8]}") for m in order}
        one.run(order, prefixes, results)
        print(
            f"rep {repetition + 1}/{args.reps} [{' '.join(results.orders[-1])}] "
            + "  ".join(
                f"{m.name} {results.series(m.name, 'save')[-1]:.2f}/"
                f"{results.series(m.name, 'load')[-1]:.2f}s"
                for m in compared
            )
            + "  (save/load, verified)",
            flush=True,
        )
    return results


def run(args: Any) -> dict[str, Any]:
    from trainsnap.testing.seaweedfs import SeaweedS3, weed_binary

    print(f"making the state ({args.gib} GiB, seed {args.seed}) ...", flush=True)
    state = make_state(args.gib, seed=args.seed, small_tensors=200)
    destination = empty_like_state(state)
    machine = machine_info() | {"loadavg_start": load_average(), "weed": weed_binary()}
    description = describe_state(state)
    print(facts("machine", machine))
    print(facts("state", description))
    threads, piece = machine["io_threads"], tunables.get().chunk_size
    with SeaweedS3() as server:
        compared = methods(threads, piece, server.options)
        with set_up(compared):
            results = repeat(compared, state, destination, server, args)
    machine["loadavg_end"] = load_average()
    config = {"gib": args.gib, "reps": args.reps, "seed": args.seed, "io_threads": threads}
    config["raw_piece"] = piece
    return {"machine": machine, "config": config, "state": description, "results": results}


def report(out: dict[str, Any]) -> tuple[str, list[Any]]:
    results: Measurements = out["results"]
    nbytes, config = out["state"]["bytes"], out["config"]
    comparison = compare(
        results,
        nbytes=nbytes,
        metrics=("save", "load"),
        ratios=ratios(),
        ratio_title="trainsnap time / other's time (median; lower is better for trainsnap):",
    )
    lines = [
        "",
        f"state {nbytes / GiB:.3f} GiB ({nbytes} bytes, {out['state']['tensors']} tensors) on "
        f"SeaweedFS S3 (loopback), {config['reps']} repetitions of 1 save and 1 load, "
        f"io_threads={config['io_threads']}, raw pieces of {config['raw_piece']} bytes; load "
        f"average (1/5/15 min) at start {out['machine']['loadavg_start']}, at end "
        f"{out['machine']['loadavg_end']}",
        "",
        *comparison.lines,
    ]
    return "\n".join(lines), comparison.checks


def main(argv: list[str] | None = None) -> int:
    arguments = cli.parser(__doc__, reps=3)
    arguments.add_argument(
        "--gib", type=float, default=0.25, help="state size in GiB (default 0.25)"
    )
    args = cli.parse(arguments, argv, SMOKE)
    out = run(args)
    text, out["checks"] = report(out)
    emit(out, text, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
