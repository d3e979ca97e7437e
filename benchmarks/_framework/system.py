"""The machine a benchmark runs on: what it is, how loaded it is, its page cache, and scratch
directories.

A shared machine can dominate the timings, so every report says how busy it was: the load
averages, and (Linux) the CPU time other processes used while a part ran.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import trainsnap as ts
from trainsnap import tunables

GiB = 1 << 30


def machine_info() -> dict[str, Any]:
    """CPUs, platform, versions, memory and trainsnap's ``io_threads``, for the report's header."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(ValueError, OSError, AttributeError):
        pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        info["memory_gib"] = round(pages / GiB, 1)
    info["trainsnap"] = ts.__version__
    info["io_threads"] = tunables.get().io_threads
    return info


def load_average() -> str:
    """The 1/5/15-minute load averages, ``a/b/c`` (``n/a`` where the system has none): well
    above this run's own processes means that something else shared the machine."""
    try:
        return "/".join(f"{load:.2f}" for load in os.getloadavg())
    except (OSError, AttributeError):
        return "n/a"


# -- CPU contention (Linux /proc) ------------------------------------------------------------------


def _process_cpu(stat_text: str) -> tuple[int, int]:
    """(parent pid, utime + stime in clock ticks) from the text of ``/proc/<pid>/stat``."""
    fields = stat_text[stat_text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def _kernel_thread_ticks() -> int:
    """CPU ticks of the kernel threads (children of kthreadd, pid 2): writeback, journaling."""
    ticks = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent, used = _process_cpu(f.read())
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if parent == 2 or pid == "2":
            ticks += used
    return ticks


def cpu_times() -> dict[str, float] | None:
    """CPU seconds so far: ``busy`` of every CPU (user, nice, system), this process's, the
    kernel threads' (mostly work this run causes) and the host's ``steal``; None without
    ``/proc``."""
    try:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        kernel = _kernel_thread_ticks()
    except (OSError, ValueError):
        return None
    hertz = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return {
        "busy": sum(cpu[:3]) / hertz,
        "self": own.user + own.system,
        "kernel_threads": kernel / hertz,
        "steal": cpu[7] / hertz if len(cpu) > 7 else 0.0,
    }


def contention(start: dict[str, float] | None, wall_s: float) -> dict[str, Any] | None:
    """CPU time other processes used (and the host stole) since ``start`` (a :func:`cpu_times`):
    all the CPUs' busy time less this process's and the kernel threads'."""
    end = cpu_times()
    if start is None or end is None:
        return None
    used = {key: end[key] - start[key] for key in end}
    others = max(0.0, used["busy"] - used["self"] - used["kernel_threads"])
    return {
        "wall_s": round(wall_s, 1),
        "self_cpu_s": round(used["self"], 1),
        "kernel_threads_cpu_s": round(used["kernel_threads"], 1),
        "other_processes_cpu_s": round(others, 1),
        "other_processes_share": round(others / (wall_s * (os.cpu_count() or 1)), 3),
        "steal_s": round(used["steal"], 1),
    }


def describe_contention(part: str, used: dict[str, Any]) -> str:
    """One report line of a :func:`contention` record."""
    return (
        f"CPU time during {part} ({used['wall_s']}s x {os.cpu_count()} CPUs): this process "
        f"{used['self_cpu_s']}s, kernel threads {used['kernel_threads_cpu_s']}s, other processes "
        f"{used['other_processes_cpu_s']}s ({100 * used['other_processes_share']:.1f}% of the "
        f"CPUs), stolen by the host {used['steal_s']}s"
    )


# -- the page cache --------------------------------------------------------------------------------


def iter_files(directory: str | os.PathLike[str]) -> Iterator[Path]:
    for parent, _subdirectories, names in os.walk(directory):
        for name in names:
            yield Path(parent) / name


def evict(directory: str | os.PathLike[str]) -> None:
    """Drop every file under ``directory`` from the page cache (``POSIX_FADV_DONTNEED``). Only
    clean pages are dropped: call it on files that were fsynced."""
    for path in iter_files(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc: Any = None


def _mincore_libc() -> Any:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        int_ = ctypes.c_int
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, int_, int_, int_, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc = lib
    return _libc


def _resident_pages(lib: Any, path: Path, page: int) -> tuple[int, int] | None:
    """(resident pages, pages) of one file, from ``mincore`` on a read-only mapping of it."""
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        address = lib.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + page - 1) // page
            vector = ctypes.create_string_buffer(pages)
            if lib.mincore(address, size, vector) != 0:
                return None
            return sum(byte & 1 for byte in vector.raw), pages
        finally:
            lib.munmap(address, size)
    finally:
        os.close(fd)


def resident_fraction(directory: str | os.PathLike[str]) -> float | None:
    """The fraction of the pages of the files under ``directory`` that are in the page cache,
    or None where that cannot be asked (not Linux)."""
    if platform.system() != "Linux":
        return None
    try:
        lib = _mincore_libc()
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in iter_files(directory):
        counted = _resident_pages(lib, path, page)
        if counted is None:
            return None
        resident += counted[0]
        total += counted[1]
    return resident / total if total else 0.0


def percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.1f}%"


# -- directories -----------------------------------------------------------------------------------


@contextlib.contextmanager
def fresh_dir(root: str | os.PathLike[str], prefix: str = "run-") -> Iterator[Path]:
    """A new empty directory under ``root``, removed with its contents on exit."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in prefix)
    directory = Path(tempfile.mkdtemp(prefix=safe, dir=root))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def scratch_root(where: str | None, need_bytes: float, prefix: str) -> Iterator[Path]:
    """A new directory for a benchmark's files under ``where`` (default: the system's temporary
    directory), removed at the end; exits when fewer than ``need_bytes`` bytes are free there."""
    base = Path(where) if where else Path(tempfile.gettempdir())
    free = shutil.disk_usage(base).free
    if free < need_bytes:
        raise SystemExit(
            f"{base}: {free / GiB:.1f} GiB free, this run needs ~{need_bytes / GiB:.1f} GiB"
        )
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    print(f"directory: {root} ({free / GiB:.0f} GiB free)", flush=True)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
