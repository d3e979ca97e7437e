"""The GPU check: what only a machine with CUDA devices can show, in one short run.

Three parts, each with its verdict:

1. **Async pause.** A state of ``--gib`` GiB of CUDA tensors (``make_state``, moved to the
   device). Each repetition times one device-to-host copy of every tensor into pinned host
   buffers allocated beforehand (``copy_(non_blocking=True)`` then one synchronize: the limit of
   any staging), and ``trainsnap.async_save`` of the same state (its pause: the time the caller
   is blocked), then the time until the snapshot is durable (``handle.wait()``). Target: pause
   <= 1.3x the copy (medians). The snapshot is loaded back onto the device and compared bit for
   bit.
2. **Strict resume with the CUDA RNG.** A small model with dropout on the device trains a few
   steps, is saved with its optimizer and RNG (``ts.TrainState``), trains on recording its
   losses; a fresh model and optimizer restored from the snapshot repeat those steps: every loss
   must be bitwise the same (dropout masks come from the restored CUDA generator).
3. **NCCL.** One rank per GPU present (``torch.cuda.device_count()``), an NCCL process group:
   each rank saves its shard of a tensor from its device and loads the whole back onto it;
   bitwise.
4. **Memory tier.** The state of part 1 (``--memory-gib`` GiB) on the device and a compute step
   (fp32 matmuls on the device) of ``--factor`` (25) times one device-to-host copy of the
   state: ``--steps`` steps with no snapshot, then as many each followed by ``mgr.step`` of a
   ``ts.CheckpointManager(memory=ts.MemoryTier(interval=Every(steps=1), wait_if_busy=True))``
   (a memory snapshot every step, in a tmpfs directory: its copy is staged on a side stream
   while the next step's kernels are queued, its hashing and writing on host threads), the
   order alternating over ``--reps`` repetitions; each step ends with a synchronize. Targets:
   the extra step time (per repetition, then the median) <= 1.2x one copy and <= 5% of the
   step. The last memory snapshot is restored onto the device and compared bit for bit.

``--cpu-dry-run`` runs the same steps on CPU (host tensors and a plain copy, the CPU generator,
2 gloo ranks): the suite runs it, so the script is known to work before a GPU is lent.

    python -m benchmarks.gpu_check                    # one GPU machine, 4 GiB, under 9 minutes
    python -m benchmarks.gpu_check --gib 8 --reps 5
    python -m benchmarks.gpu_check --cpu-dry-run      # anywhere
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import trainsnap as ts
from benchmarks._framework import cli
from benchmarks._framework.report import Check, Target, emit, format_table, verdicts
from benchmarks._framework.state import make_state
from trainsnap.testing import assert_all_ok, run_ranks

PAUSE_TARGET = Target("<=", 1.3)
MEMORY_COPY_TARGET = Target("<=", 1.2)  # extra step time of a memory snapshot / one copy
MEMORY_STEP_TARGET = Target("<=", 5.0)  # the same, % of the step
SMOKE = {"gib": 0.01, "memory_gib": 0.005, "reps": 1, "steps": 2, "cpu_dry_run": True}
PERFORMANCE = ("async pause / device-to-host copy", "memory snapshot: extra step / one copy")
"""Labels (prefixes) of the checks that measure speed: reported, never the exit status (a CPU
dry run measures nothing)."""


def _pause(device: str, gib: float, reps: int, workdir: Path) -> dict[str, Any]:
    state = {k: v.to(device) for k, v in make_state(gib, small_tensors=200).items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    pinned = device == "cuda"
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pinned) for k, v in state.items()}
    for h in host.values():
        h.fill_(0)  # touched: the copy measures copying, not page faults
    saver = ts.AsyncSaver()
    copies, pauses, durable = [], [], []
    for rep in range(reps + 1):  # the first is a warm-up (pools, CUDA contexts)
        _sync(device)
        start = time.perf_counter()
        for k, v in state.items():
            host[k].copy_(v, non_blocking=pinned)
        _sync(device)
        copy_s = time.perf_counter() - start
        root = workdir / f"pause{rep}"
        start = time.perf_counter()
        handle = ts.async_save(state, root, step=rep + 1, saver=saver, no_dist=True)
        pause_s = handle.pause
        handle.wait()
        durable_s = time.perf_counter() - start
        if rep:
            copies.append(copy_s)
            pauses.append(pause_s)
            durable.append(durable_s)
        if rep == reps:
            back = {k: torch.empty_like(v) for k, v in state.items()}
            ts.load(back, root)
            bad = [k for k in state if not torch.equal(back[k], state[k])]
            if bad:
                raise AssertionError(f"the snapshot loaded back differs at {bad[:3]}")
        shutil.rmtree(root)
    saver.close()
    copy, pause = statistics.median(copies), statistics.median(pauses)
    return {
        "bytes": nbytes,
        "copy_s": copy,
        "pause_s": pause,
        "durable_s": statistics.median(durable),
        "pause_over_copy": pause / copy,
        "pinned": pinned,
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _model(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    ).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, device: str, n: int) -> list[float]:
    losses = []
    x = torch.ones(32, 64, device=device)
    for _ in range(n):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _strict_resume(device: str, workdir: Path) -> dict[str, Any]:
    model, opt = _model(device)
    _steps(model, opt, device, 3)
    state = ts.TrainState(model=model, optimizer=opt, no_data_order=True)  # one fixed batch
    ts.save(state, workdir / "resume", step=3, no_dist=True)
    expected = _steps(model, opt, device, 4)
    model2, opt2 = _model(device)
    torch.manual_seed(123)  # a different RNG state: the restore must bring the saved one back
    info = ts.load(
        ts.TrainState(model=model2, optimizer=opt2, no_data_order=True), workdir / "resume"
    )
    got = _steps(model2, opt2, device, 4)
    return {"level": info.level, "losses_equal": got == expected, "losses": got}


def _nccl_rank(rank: int, world: int, root: str, backend: str, init: str) -> bool:
    import torch.distributed as dist

    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        rows = 4
        local = torch.arange(rows * 8, dtype=torch.float32, device=device).reshape(rows, 8) + rank
        piece = ts.Sharded(local, global_shape=(rows * world, 8), offsets=(rows * rank, 0))
        ts.save({"w": piece}, root, step=1, timeout=120)
        whole = torch.empty(rows * world, 8, device=device)
        ts.load({"w": ts.Sharded(whole, global_shape=(rows * world, 8))}, root, timeout=120)
        expected = torch.cat(
            [torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 8) + r for r in range(world)]
        )
        return bool(torch.equal(whole.cpu(), expected))
    finally:
        dist.destroy_process_group()


def _collective(dry: bool, workdir: Path) -> dict[str, Any]:
    world = 2 if dry else torch.cuda.device_count()
    backend = "gloo" if dry else "nccl"
    init = f"file://{workdir / 'rendezvous'}"
    results = run_ranks(
        _nccl_rank,
        world,
        args=(str(workdir / "collective"), backend, init),
        init_pg=False,
        timeout=300,
    )
    return {"backend": backend, "world": world, "bitwise": all(assert_all_ok(results))}


def _device_matmuls(device: str, seconds: float) -> tuple[Any, int]:
    """A step of fp32 matmuls on ``device`` lasting about ``seconds`` (at least one)."""
    n = 4096 if device == "cuda" else 256
    generator = torch.Generator().manual_seed(1)
    a, b = (torch.randn(n, n, generator=generator).to(device) for _ in range(2))
    c = torch.empty(n, n, device=device)

    def step(count: int) -> None:
        for _ in range(count):
            torch.mm(a, b, out=c)

    step(3)
    _sync(device)
    start = time.perf_counter()
    step(5)
    _sync(device)
    one = (time.perf_counter() - start) / 5
    return step, max(1, round(seconds / one))


def _memory_tier(
    device: str, gib: float, reps: int, steps: int, factor: float, workdir: Path
) -> dict[str, Any]:
    """Part 4 (module docstring)."""
    state = {k: v.to(device) for k, v in make_state(gib, small_tensors=200).items()}
    pinned = device == "cuda"
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pinned) for k, v in state.items()}
    copies = []
    for _ in range(4):  # the first is a warm-up
        _sync(device)
        start = time.perf_counter()
        for k, v in state.items():
            host[k].copy_(v, non_blocking=pinned)
        _sync(device)
        copies.append(time.perf_counter() - start)
    copy_s = statistics.median(copies[1:])
    compute, count = _device_matmuls(device, factor * copy_s)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else workdir
    tier_root = Path(tempfile.mkdtemp(prefix="trainsnap-gpu-memory-", dir=shm))
    tier = ts.MemoryTier(
        root=str(tier_root), interval=ts.Every(steps=1), wait_if_busy=True, allow_fewer_copies=True
    )
    options = ts.ManagerOptions(preemption_signals=())
    durable = workdir / "memory-durable"
    medians: dict[str, list[float]] = {"none": [], "memory": []}
    try:
        mgr = ts.CheckpointManager(
            durable, interval=ts.Every(steps=10**9), memory=tier, options=options
        )
        try:
            step = 1
            mgr.step(step, state)  # warm-up: the footprint check, the staging pool
            mgr.wait()
            for rep in range(reps):
                for kind in ("none", "memory") if rep % 2 == 0 else ("memory", "none"):
                    times = []
                    for _ in range(steps):
                        step += 1
                        _sync(device)
                        start = time.perf_counter()
                        compute(count)
                        if kind == "memory":
                            mgr.step(step, state)
                        _sync(device)
                        times.append(time.perf_counter() - start)
                    mgr.wait()
                    medians[kind].append(statistics.median(times))
        finally:
            mgr.close()
        back = {k: torch.empty_like(v) for k, v in state.items()}
        with ts.CheckpointManager(durable, memory=tier, options=options) as again:
            info = again.restore(back)
        bitwise = info is not None and all(torch.equal(back[k], state[k]) for k in state)
    finally:
        shutil.rmtree(tier_root, ignore_errors=True)
    extra = statistics.median(
        m - n for m, n in zip(medians["memory"], medians["none"], strict=True)
    )
    step_s = statistics.median(medians["none"])
    return {
        "bytes": sum(v.numel() * v.element_size() for v in state.values()),
        "copy_s": copy_s,
        "step_none_s": step_s,
        "step_memory_s": statistics.median(medians["memory"]),
        "extra_s": extra,
        "extra_over_copy": extra / copy_s,
        "extra_percent_of_step": 100 * extra / step_s,
        "factor": factor,
        "restored_bitwise": bitwise,
        "medians": medians,
    }


def run(args: Any) -> dict[str, Any]:
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --cpu-dry-run, or on a GPU machine")
    device = "cpu" if dry else "cuda"
    workdir = Path(tempfile.mkdtemp(prefix="trainsnap-gpu-check-", dir=args.dir))
    started = time.perf_counter()
    try:
        out: dict[str, Any] = {"device": device, "dry_run": dry}
        if not dry:
            out["gpu"] = torch.cuda.get_device_name(0)
        out["pause"] = _pause(device, args.gib, args.reps, workdir)
        out["resume"] = _strict_resume(device, workdir)
        out["collective"] = _collective(dry, workdir)
        out["memory"] = _memory_tier(
            device, args.memory_gib, args.reps, args.steps, args.factor, workdir
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out["seconds"] = time.perf_counter() - started
    return out


def report(out: dict[str, Any]) -> tuple[str, list[Check]]:
    p, r, c, m = out["pause"], out["resume"], out["collective"], out["memory"]
    checks = [
        Check("async pause / device-to-host copy", p["pause_over_copy"], PAUSE_TARGET),
        Check("strict resume: losses bitwise equal", float(r["losses_equal"]), Target(">=", 1.0)),
        Check(f"{c['backend']} save/load bitwise", float(c["bitwise"]), Target(">=", 1.0)),
        Check("memory snapshot: extra step / one copy", m["extra_over_copy"], MEMORY_COPY_TARGET),
        Check(
            "memory snapshot: extra step / one copy, % of the step",
            m["extra_percent_of_step"],
            MEMORY_STEP_TARGET,
        ),
        Check("memory tier restore bitwise", float(m["restored_bitwise"]), Target(">=", 1.0)),
    ]
    what = "GPU " + out.get("gpu", "") if not out["dry_run"] else "CPU dry run"
    rows = [
        ["state", f"{p['bytes'] / 2**30:.2f} GiB", "pinned" if p["pinned"] else "pageable"],
        ["device-to-host copy (median)", f"{p['copy_s']:.3f} s", ""],
        ["async_save pause (median)", f"{p['pause_s']:.3f} s", ""],
        ["time to durable (median)", f"{p['durable_s']:.3f} s", ""],
        ["strict resume level", r["level"], ""],
        [f"{c['backend']} ranks", c["world"], ""],
        ["memory tier state", f"{m['bytes'] / 2**30:.2f} GiB", ""],
        ["  one device-to-host copy (median)", f"{m['copy_s']:.4f} s", ""],
        [
            "  step, no snapshot (median)",
            f"{m['step_none_s']:.4f} s",
            f"{m['step_none_s'] / m['copy_s']:.1f}x the copy",
        ],
        ["  step, memory snapshot every step", f"{m['step_memory_s']:.4f} s", ""],
        ["  extra per step (median of reps)", f"{m['extra_s']:.4f} s", ""],
        ["whole check", f"{out['seconds']:.1f} s", ""],
    ]
    text = "\n".join(
        [f"== GPU check ({what})", format_table(["step", "value", ""], rows), "", verdicts(checks)]
    )
    return text, checks


def main(argv: list[str] | None = None) -> int:
    arguments = cli.parser(__doc__, reps=3, seed=False)
    arguments.add_argument("--gib", type=float, default=4.0, help="state size in GiB (default 4)")
    arguments.add_argument("--cpu-dry-run", action="store_true", help="the same steps on CPU")
    arguments.add_argument(
        "--memory-gib", type=float, default=1.0, help="memory tier part: state GiB (default 1)"
    )
    arguments.add_argument(
        "--steps", type=int, default=4, help="memory tier part: steps per case (default 4)"
    )
    arguments.add_argument(
        "--factor", type=float, default=25.0, help="memory tier part: step / copy (default 25)"
    )
    args = cli.parse(arguments, argv, SMOKE)
    os.environ.setdefault("TRAINSNAP_HEARTBEAT_SECONDS", "10")
    out = run(args)
    text, checks = report(out)
    out["checks"] = [{"label": k.label, "value": k.value, "result": k.result} for k in checks]
    emit(out, text, args.json)
    correctness = [k for k in checks if not k.label.startswith(PERFORMANCE)]
    return 0 if all(k.result == "met" for k in correctness) else 1


if __name__ == "__main__":
    sys.exit(main())
