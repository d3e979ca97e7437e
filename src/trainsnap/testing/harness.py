"""Run a function on N real CPU processes, one per rank, and collect what each rank did.

Every multi-rank test goes through :func:`run_ranks`, so that they all share one answer to the
hard parts: spawn (not fork: torch's threads make fork unsafe), a gloo process group over a file
rendezvous, a hard deadline after which every remaining rank is SIGKILLed, and results that
survive a rank being SIGKILLed mid-way.

Results travel through one pickle file per rank in a private temp dir, written atomically
(temp file + rename). A queue would not do: a rank killed while writing to a pipe can leave it
corrupt or its lock held, and a rank with unflushed queue data cannot exit. With files, a killed
rank simply leaves no file, and the harness reports it from its exit code.

Example::

    def _sum(rank: int, world_size: int) -> float:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return t.item()

    def test_sum() -> None:
        assert assert_all_ok(run_ranks(_sum, world_size=4)) == [6.0] * 4

``fn`` must be a module-level function (pickled by reference). Tests usually choose world
sizes of at most 4: CI machines may have 2 cores, and every rank imports torch at start.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from trainsnap.testing import loopback

__all__ = ["RankResult", "assert_all_ok", "errors_by_rank", "run_ranks"]

# No torch import at module level: this module is imported by each child before the child's
# environment is set, and torch reads some variables (thread counts) when it is imported.

_PARENT_POLL_S = 1.0


@dataclass(frozen=True)
class RankResult:
    """What happened to one rank.

    ``value`` is ``fn``'s return value, or ``None`` if it raised, was killed or timed out.
    ``error`` is the formatted exception (type, message, traceback) when ``fn`` raised, or when
    the harness could not deliver the value (unpicklable result, failed set-up); ``None``
    otherwise, including for killed ranks, which could not report anything.
    ``exitcode`` is the process exit status: 0 on success, 1 when ``fn`` raised, ``-N`` when it
    died from signal N (``-9`` for SIGKILL). ``killed`` is true when it died from a signal,
    whoever sent it; ``timed_out`` when the harness sent SIGKILL because the deadline passed
    (a timed-out rank is therefore also ``killed``).
    """

    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int = 0
    killed: bool = False
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """True when ``fn`` returned, its value arrived and the process exited cleanly."""
        return self.error is None and self.exitcode == 0 and not self.timed_out

    def describe(self) -> str | None:
        """Why this rank is not ok (its error text, or how it died); ``None`` when ok."""
        if self.ok:
            return None
        if self.timed_out:
            head = "timed out: killed by the harness at the deadline"
        elif self.killed:
            head = f"killed by {_signal_name(-self.exitcode)} (exitcode {self.exitcode})"
        else:
            head = f"exited with code {self.exitcode}"
        return head if self.error is None else f"{head}\n{self.error}"


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
    init_pg: bool = True,
    rendezvous: str = "file",
) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned processes.

    With ``init_pg`` each rank first joins a gloo process group (collective timeout
    ``timeout``) that is destroyed after ``fn``; without it no process group exists, which
    tests single-process behaviour inside a clean interpreter. ``rendezvous`` is ``"file"`` (a
    file store in a fresh temp dir) or ``"tcp"`` (a TCPStore hosted by rank 0 on a free port of
    127.0.0.1, as torchrun makes: its key-value traffic goes over a socket, not through a file
    every rank re-reads; it listens on IPv4, see :mod:`trainsnap.testing.loopback`).

    Each rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``TRAINSNAP_RANK``, then ``env``,
    then ``rank_env[rank]`` (e.g. ``{1: {"TRAINSNAP_FAULTS": "mid_write=crash"}}``), all set
    in the child before it imports torch or ``fn``'s module. The parent's environment is
    inherited underneath.

    Any rank still alive ``timeout`` seconds after the start is SIGKILLed and reported with
    ``timed_out=True``; the call itself never outlives the deadline by more than the time to
    reap the processes. Children are killed on any exit of this function, including
    KeyboardInterrupt or a pytest timeout, and exit on their own if this process dies (only
    then is the temp dir left behind).

    Returns one :class:`RankResult` per rank, in rank order.
    """
    _check_arguments(world_size, timeout, rank_env)
    if rendezvous not in ("file", "tcp"):
        raise ValueError(f"rendezvous must be 'file' or 'tcp', got {rendezvous!r}")
    payload = _payload(fn, args, kwargs or {})
    import_paths = _import_paths(fn)
    workdir = Path(tempfile.mkdtemp(prefix="trainsnap-ranks-"))
    init_method = (workdir / "rendezvous").as_uri()
    if rendezvous == "tcp":
        init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = get_context("spawn")
    procs: list[Any] = []
    try:
        deadline = time.monotonic() + timeout
        for rank in range(world_size):
            spec = _ChildSpec(
                rank=rank,
                world_size=world_size,
                payload=payload,
                import_paths=import_paths,
                env=_rank_environment(rank, world_size, env, rank_env),
                init_method=init_method if init_pg else None,
                timeout=timeout,
                result_path=str(_result_path(workdir, rank)),
                parent_pid=os.getpid(),
            )
            proc = ctx.Process(target=_child_main, args=(spec,), name=f"rank{rank}")
            proc.start()
            procs.append(proc)
        timed_out = _wait_until(procs, deadline)
        return [_collect(workdir, rank, p, rank in timed_out) for rank, p in enumerate(procs)]
    finally:
        _kill_all(procs)
        shutil.rmtree(workdir, ignore_errors=True)


def errors_by_rank(results: Sequence[RankResult]) -> dict[int, str]:
    """Map each rank that is not ok to its description (error text or how it died)."""
    return {r.rank: text for r in results if (text := r.describe()) is not None}


def assert_all_ok(results: Sequence[RankResult]) -> list[Any]:
    """Fail with every failing rank's story at once; return the values in rank order.

    Reporting all ranks matters: the first failure is often a symptom (a peer hung up) of
    another rank's real error.
    """
    errors = errors_by_rank(results)
    if errors:
        parts = [f"--- rank {rank}: {text}" for rank, text in sorted(errors.items())]
        raise AssertionError(f"{len(errors)} of {len(results)} ranks failed:\n" + "\n".join(parts))
    return [r.value for r in results]


# --- parent side -------------------------------------------------------------------------------


def _check_arguments(
    world_size: int, timeout: float, rank_env: Mapping[int, Mapping[str, str]] | None
) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    stray = sorted(set(rank_env or {}) - set(range(world_size)))
    if stray:
        raise ValueError(f"rank_env names ranks {stray} outside 0..{world_size - 1}")


def _payload(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
    """Pickle the call here, so that a lambda or a local function fails now, in the test, and
    so that the child unpickles it only after it has set up sys.path and its environment."""
    try:
        return pickle.dumps((fn, tuple(args), dict(kwargs)))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"run_ranks needs a module-level fn and picklable args; {fn!r}: {exc}"
        ) from exc


def _import_paths(fn: Callable[..., Any]) -> list[str]:
    """Directories the child needs on sys.path to import ``fn``'s module (this harness is
    imported as part of the installed package)."""
    paths: list[str] = []
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    file = getattr(module, "__file__", None)
    if module is not None and file:
        root = Path(file).resolve().parent
        depth = module.__name__.count(".") + (Path(file).stem == "__init__")
        for _ in range(depth):
            root = root.parent
        paths.insert(0, str(root))
    return list(dict.fromkeys(paths))


def _rank_environment(
    rank: int,
    world_size: int,
    env: Mapping[str, str] | None,
    rank_env: Mapping[int, Mapping[str, str]] | None,
) -> dict[str, str]:
    merged = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "TRAINSNAP_RANK": str(rank),
        # Up to 4 ranks share 2 cores: one intra-op thread each, or they thrash.
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
        # All ranks are on this host; loopback avoids hosts whose name resolves to an
        # unreachable or firewalled address.
        merged["GLOO_SOCKET_IFNAME"] = "lo"
    merged.update(env or {})
    merged.update((rank_env or {}).get(rank, {}))
    return merged


def _wait_until(procs: Sequence[Any], deadline: float) -> set[int]:
    """Wait for every process or the deadline; SIGKILL the stragglers and return their ranks."""
    pending = {p.sentinel: rank for rank, p in enumerate(procs)}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for sentinel in wait(list(pending), timeout=left):
            pending.pop(sentinel)
    late = set(pending.values())
    for rank in late:
        procs[rank].kill()
    for p in procs:
        p.join()
    return late


def _collect(workdir: Path, rank: int, proc: Any, timed_out: bool) -> RankResult:
    exitcode = proc.exitcode if proc.exitcode is not None else -signal.SIGKILL
    value, error = None, None
    path = _result_path(workdir, rank)
    if path.exists():
        try:
            value, error = pickle.loads(path.read_bytes())
        except Exception:
            error = "harness: could not unpickle the result:\n" + traceback.format_exc()
    elif exitcode > 0:
        error = f"harness: rank exited with code {exitcode} without reporting a result"
    return RankResult(
        rank=rank,
        value=value,
        error=error,
        exitcode=exitcode,
        killed=exitcode < 0,
        timed_out=timed_out,
    )


def _kill_all(procs: Sequence[Any]) -> None:
    """Leave no child behind, whatever interrupted us."""
    for p in procs:
        if p.exitcode is None:
            try:
                p.kill()
            except (OSError, ValueError):
                continue
    for p in procs:
        try:
            p.join(timeout=10)
        except (OSError, ValueError, AssertionError):
            continue


def _result_path(workdir: Path, rank: int) -> Path:
    return workdir / f"rank{rank}.result"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# --- child side --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ChildSpec:
    """Everything a rank needs; only plain data, so it unpickles before sys.path is set up."""

    rank: int
    world_size: int
    payload: bytes
    import_paths: list[str]
    env: dict[str, str]
    init_method: str | None
    timeout: float
    result_path: str
    parent_pid: int


def _child_main(spec: _ChildSpec) -> None:
    """Entry point of each rank: set up, run ``fn``, report, tear down; exit 1 on failure."""
    _watch_parent(spec.parent_pid)
    os.environ.update(spec.env)
    for path in reversed(spec.import_paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    value, error = None, None
    try:
        value = _run(spec)
    except BaseException:  # SystemExit or KeyboardInterrupt inside fn is a failure to report too
        error = traceback.format_exc()
    # Report before tearing down, so that a rank stuck or dying in teardown keeps its result.
    clean = _report(spec.result_path, value, error)
    _destroy_process_group()
    _exit_now(0 if clean else 1)


def _exit_now(code: int) -> None:
    """End the rank without interpreter finalization. Its result is reported and its process
    group torn down; what finalization would still do is destroy torch's C++ objects
    (store clients, gloo contexts, their threads) in an order torch does not control, which
    now and then ends a finished rank with SIGABRT ("terminate called without an active
    exception"). A rank's exit status must say whether it succeeded, nothing else."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    """A port of 127.0.0.1 free now (whoever asked binds it a moment later)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _run(spec: _ChildSpec) -> Any:
    import torch

    torch.set_num_threads(1)
    if spec.init_method is not None:
        _join_process_group(spec)
    fn, args, kwargs = pickle.loads(spec.payload)
    return fn(spec.rank, spec.world_size, *args, **kwargs)


def _join_process_group(spec: _ChildSpec) -> None:
    """The gloo default group; over ``tcp://`` rank 0 hosts the store on IPv4 (see
    :mod:`trainsnap.testing.loopback`: a dual-stack server can stall at each connection)."""
    from datetime import timedelta

    import torch.distributed as dist

    assert spec.init_method is not None
    timeout = timedelta(seconds=spec.timeout)
    join: dict[str, Any] = {"init_method": spec.init_method}
    if spec.init_method.startswith("tcp://"):
        port = int(spec.init_method.rsplit(":", 1)[1])
        if spec.rank == 0:
            store = loopback.master_store(port, timeout)
        else:
            store = loopback.client_store(port, timeout)
        join = {"store": store}
    dist.init_process_group(
        "gloo", rank=spec.rank, world_size=spec.world_size, timeout=timeout, **join
    )


def _report(result_path: str, value: Any, error: str | None) -> bool:
    """Write ``(value, error)`` atomically, so the parent never reads half a result.

    An unpicklable value is reported as an error. Returns True when a result without error was
    written.
    """
    try:
        data = pickle.dumps((value, error))
    except Exception:
        error = "harness: fn's return value is not picklable:\n" + traceback.format_exc()
        data = pickle.dumps((None, error))
    tmp = f"{result_path}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, result_path)
    except OSError:
        traceback.print_exc()
        return False
    return error is None


def _destroy_process_group() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass  # a rank whose peers died may fail to tear down; that is not what tests check


def _watch_parent(parent_pid: int) -> None:
    """Exit if the harness process dies (e.g. SIGKILLed), so no rank outlives its test run."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(70)

    threading.Thread(target=watch, name="harness-parent-watch", daemon=True).start()
