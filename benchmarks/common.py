"""Shared helpers of the benchmarks: a synthetic training state, page-cache eviction, timing,
plain-text tables, fresh directories, and the "raw" baseline (the same bytes written and read
back by a thread pool with no format and no hashing: what the disk gives).

The benchmarks run as scripts (``python benchmarks/<name>.py``) and import this module as
``from common import ...``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

T = TypeVar("T")

# -- the state -------------------------------------------------------------------------------------

# Large 2-D weights, as fractions of the total (embedding, output head, a fused projection), with
# their dtypes. What they leave (less the small tensors) goes to medium weights.
_LARGE: tuple[tuple[str, float, torch.dtype], ...] = (
    ("embed.weight", 0.22, torch.float32),
    ("lm_head.weight", 0.14, torch.bfloat16),
    ("fused_qkv.weight", 0.09, torch.float32),
)
# Medium weights cycle through these sizes (MiB at a 1 GiB state; they scale with the total).
_MEDIUM_MIB: tuple[int, ...] = (4, 12, 8, 24, 16, 6)
# Small tensors (biases, norms): (elements, dtype), cycled; 2-8 KiB each.
_SMALL: tuple[tuple[int, torch.dtype], ...] = (
    (1024, torch.float32),
    (2048, torch.bfloat16),
    (2048, torch.float32),
    (1536, torch.bfloat16),
    (4096, torch.bfloat16),
)


def _rows(nbytes: int, cols: int, dtype: torch.dtype) -> int:
    return max(1, nbytes // (cols * dtype.itemsize))


def make_state(gib: float = 1.0, *, n_small: int = 2000, seed: int = 0) -> dict[str, torch.Tensor]:
    """A flat dict of contiguous CPU tensors of about ``gib`` GiB, fp32 and bf16, deterministic
    for a given ``seed``: a few large 2-D weights (tens to hundreds of MiB at 1 GiB), medium
    2-D weights, and ``n_small`` small 1-D tensors of a few KiB, interleaved with the medium
    weights as a model's layers would be.
    """
    if gib <= 0:
        raise ValueError(f"gib must be positive, got {gib}")
    total = int(gib * GiB)
    gen = torch.Generator().manual_seed(seed)

    def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)

    small_specs = [_SMALL[i % len(_SMALL)] for i in range(n_small)]
    small_bytes = sum(n * dt.itemsize for n, dt in small_specs)

    state: dict[str, torch.Tensor] = {}
    used = 0
    for name, frac, dt in _LARGE:
        cols = 4096 if total >= 256 * MiB else 1024
        t = rand((_rows(int(frac * total), cols, dt), cols), dt)
        state[name] = t
        used += t.nbytes

    budget = max(0, total - used - small_bytes)
    scale = total / GiB
    medium: list[tuple[int, torch.dtype, int]] = []
    i = 0
    while budget > 0:
        nbytes = min(budget, max(64 * KiB, int(_MEDIUM_MIB[i % len(_MEDIUM_MIB)] * MiB * scale)))
        dt = torch.float32 if i % 3 != 2 else torch.bfloat16
        cols = (1024, 2048, 4096)[i % 3]
        medium.append((_rows(nbytes, cols, dt), dt, cols))
        budget -= nbytes
        i += 1

    # Interleave: each medium weight is followed by its share of the small tensors.
    per_layer = math.ceil(n_small / max(1, len(medium)))
    s = 0
    for layer, (rows, dt, cols) in enumerate(medium):
        state[f"layers.{layer}.weight"] = rand((rows, cols), dt)
        for j in range(per_layer):
            if s == n_small:
                break
            n, sdt = small_specs[s]
            state[f"layers.{layer}.norm{j}"] = rand((n,), sdt)
            s += 1
    while s < n_small:  # no medium weights at all (a tiny state)
        n, sdt = small_specs[s]
        state[f"extra.{s}"] = rand((n,), sdt)
        s += 1
    return state


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in state.values())


def describe_state(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Counts and sizes of a state, for reports."""
    sizes = sorted((t.nbytes for t in state.values()), reverse=True)
    by_dtype: dict[str, int] = {}
    for t in state.values():
        k = str(t.dtype).removeprefix("torch.")
        by_dtype[k] = by_dtype.get(k, 0) + t.nbytes
    return {
        "tensors": len(sizes),
        "bytes": sum(sizes),
        "largest_mib": [round(n / MiB, 1) for n in sizes[:3]],
        "at_least_1mib": sum(1 for n in sizes if n >= MiB),
        "under_64kib": sum(1 for n in sizes if n < 64 * KiB),
        "bytes_by_dtype": by_dtype,
    }


def empty_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Preallocated (and touched) destinations of the same shapes and dtypes."""
    return {k: torch.zeros_like(t) for k, t in state.items()}


def clear_state(state: dict[str, torch.Tensor]) -> None:
    for t in state.values():
        t.zero_()


def check_bitwise_equal(
    expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str
) -> None:
    """Raise AssertionError unless every tensor of ``got`` has the bytes of ``expected``."""
    if expected.keys() != got.keys():
        missing = sorted(expected.keys() - got.keys())[:5]
        extra = sorted(got.keys() - expected.keys())[:5]
        raise AssertionError(f"{what}: keys differ (missing {missing}, extra {extra})")
    bad = []
    for k, e in expected.items():
        g = got[k]
        if g.dtype != e.dtype or g.shape != e.shape:
            bad.append(f"{k}: {g.dtype}{list(g.shape)} != {e.dtype}{list(e.shape)}")
        elif not torch.equal(tensor_bytes_tensor(g), tensor_bytes_tensor(e)):
            bad.append(f"{k}: bytes differ")
    if bad:
        raise AssertionError(f"{what}: {len(bad)} tensor(s) wrong, e.g. {bad[:5]}")


def tensor_bytes_tensor(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8)


def tensor_view(t: torch.Tensor) -> memoryview:
    """A writable byte memoryview of a contiguous CPU tensor (no copy)."""
    assert t.device.type == "cpu" and t.is_contiguous()
    return memoryview(tensor_bytes_tensor(t).numpy()).cast("B")


# -- the page cache --------------------------------------------------------------------------------


def iter_files(directory: str | os.PathLike[str]) -> Iterator[Path]:
    for dirpath, _dirs, names in os.walk(directory):
        for n in names:
            yield Path(dirpath) / n


def evict(directory: str | os.PathLike[str]) -> tuple[int, int]:
    """Drop every file under ``directory`` from the page cache (``POSIX_FADV_DONTNEED``).

    Only clean pages are dropped: call it on files that were fsynced. Returns (files, bytes).
    """
    nfiles = nbytes = 0
    for p in iter_files(directory):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            nbytes += os.fstat(fd).st_size
        finally:
            os.close(fd)
        nfiles += 1
    return nfiles, nbytes


_libc: Any = None


def _mincore_libc() -> Any:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        lib = ctypes.CDLL(name, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc = lib
    return _libc


def resident_fraction(directory: str | os.PathLike[str]) -> float | None:
    """The fraction of the pages of the files under ``directory`` that are in the page cache
    (``mincore``), or None where that cannot be asked (not Linux)."""
    if platform.system() != "Linux":
        return None
    try:
        lib = _mincore_libc()
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for p in iter_files(directory):
        size = p.stat().st_size
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = lib.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                npages = (size + page - 1) // page
                vec = ctypes.create_string_buffer(npages)
                if lib.mincore(addr, size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in vec.raw)
                total += npages
            finally:
                lib.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


# -- timing ----------------------------------------------------------------------------------------


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB per second."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan


def rotated(items: Sequence[T], k: int) -> list[T]:
    """``items`` rotated left by ``k`` (each repetition starts with the next method)."""
    if not items:
        return []
    k %= len(items)
    return [*items[k:], *items[:k]]


# -- plain-text tables -----------------------------------------------------------------------------


def fmt(x: object, digits: int = 3) -> str:
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:.{digits}f}"
    return str(x)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], digits: int = 3) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    cells = [[fmt(c, digits) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))

    def line(cs: Sequence[str]) -> str:
        parts = [c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(cs)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in cells)])


# -- directories -----------------------------------------------------------------------------------


@contextlib.contextmanager
def fresh_dir(root: str | os.PathLike[str], prefix: str = "run-") -> Iterator[Path]:
    """A new empty directory under ``root``, removed with its contents on exit."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in prefix)
    d = Path(tempfile.mkdtemp(prefix=safe, dir=root))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def scratch_root(where: str | None, need: float, prefix: str) -> tuple[Path, int]:
    """A new directory for a benchmark's files under ``where`` (default: the system's temporary
    directory), and the free bytes there; exits if fewer than ``need`` bytes are free."""
    base = Path(where) if where else Path(tempfile.gettempdir())
    free = shutil.disk_usage(base).free
    if free < need:
        raise SystemExit(f"{base}: {free / GiB:.1f} GiB free, this run needs ~{need / GiB:.1f} GiB")
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base)), free


def emit(out: dict[str, Any], text: str, json_path: str | None) -> None:
    """Print a benchmark's report and, when asked, write its results as JSON."""
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(f"wrote {json_path}")


def fsync_dir(d: str | os.PathLike[str]) -> None:
    fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def kv(d: dict[str, Any]) -> str:
    """``k=v, k=v`` of a dict, for one-line reports (the machine line)."""
    return ", ".join(f"{k}={v}" for k, v in d.items())


def machine_info() -> dict[str, Any]:
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
        info["memory_gib"] = round(
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1
        )
    return info


# -- the raw baseline ------------------------------------------------------------------------------

_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
_MAX_IO = 1 << 30  # bytes per system call (Linux caps one call near 2 GiB)


@dataclass(frozen=True, slots=True)
class RawLayout:
    """The concatenation of the tensors' bytes cut into ``len(files)`` nearly equal files.

    ``files[i]`` lists (tensor index, byte offset in the tensor, length) in file order.
    """

    files: list[list[tuple[int, int, int]]]
    sizes: list[int]

    @staticmethod
    def plan(nbytes: Sequence[int], nfiles: int) -> RawLayout:
        total = sum(nbytes)
        nfiles = max(1, min(nfiles, total)) if total else 1
        bounds = [total * (i + 1) // nfiles for i in range(nfiles)]
        files: list[list[tuple[int, int, int]]] = [[] for _ in range(nfiles)]
        sizes = [0] * nfiles
        f, pos = 0, 0
        for ti, n in enumerate(nbytes):
            off = 0
            while off < n:
                while pos >= bounds[f]:
                    f += 1
                take = min(n - off, bounds[f] - pos)
                files[f].append((ti, off, take))
                sizes[f] += take
                off += take
                pos += take
        return RawLayout(files, sizes)


def _pieces(views: Sequence[memoryview], parts: list[tuple[int, int, int]]) -> list[memoryview]:
    out = []
    for ti, off, n in parts:
        for lo in range(off, off + n, _MAX_IO):
            out.append(views[ti][lo : min(off + n, lo + _MAX_IO)])
    return out


def _batches(bufs: list[memoryview]) -> Iterator[list[memoryview]]:
    batch: list[memoryview] = []
    size = 0
    for b in bufs:
        if batch and (len(batch) == _IOV_MAX or size + len(b) > _MAX_IO):
            yield batch
            batch, size = [], 0
        batch.append(b)
        size += len(b)
    if batch:
        yield batch


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` less its first ``n`` bytes."""
    i = 0
    while i < len(bufs) and n >= len(bufs[i]):
        n -= len(bufs[i])
        i += 1
    rest = bufs[i:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def _write_file(path: Path, bufs: list[memoryview]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for first in _batches(bufs):
            batch = first
            while batch:
                batch = _advance(batch, os.writev(fd, batch))
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_file(path: Path, bufs: list[memoryview]) -> int:
    fd = os.open(path, os.O_RDONLY)
    pos = 0
    try:
        for first in _batches(bufs):
            batch = first
            while batch:
                n = os.preadv(fd, batch, pos)
                if n == 0:
                    raise OSError(f"{path}: short read at byte {pos}")
                pos += n
                batch = _advance(batch, n)
    finally:
        os.close(fd)
    return pos


def raw_file_name(i: int) -> str:
    return f"part-{i:04d}.bin"


def _run(threads: int, fn: Callable[[int], T], n: int) -> list[T]:
    if threads <= 1 or n == 1:
        return [fn(i) for i in range(n)]
    with ThreadPoolExecutor(max_workers=min(threads, n)) as pool:
        return list(pool.map(fn, range(n)))


def raw_write(
    tensors: Sequence[torch.Tensor], directory: str | os.PathLike[str], threads: int
) -> RawLayout:
    """Write the tensors' bytes into ``threads`` files of ``directory`` (one per thread) with
    ``writev``, fsync each file, then the directory. No format, no hashing."""
    d = Path(directory)
    views = [tensor_view(t) for t in tensors]
    layout = RawLayout.plan([len(v) for v in views], threads)
    _run(
        threads,
        lambda i: _write_file(d / raw_file_name(i), _pieces(views, layout.files[i])),
        len(layout.files),
    )
    fsync_dir(d)
    return layout


def raw_read(
    tensors: Sequence[torch.Tensor],
    directory: str | os.PathLike[str],
    threads: int,
    layout: RawLayout | None = None,
) -> int:
    """Read files written by :func:`raw_write` back into ``tensors`` (preallocated, same sizes)
    with ``preadv``, one thread per file. Returns the bytes read."""
    d = Path(directory)
    views = [tensor_view(t) for t in tensors]
    if layout is None:
        layout = RawLayout.plan([len(v) for v in views], threads)
    got = _run(
        threads,
        lambda i: _read_file(d / raw_file_name(i), _pieces(views, layout.files[i])),
        len(layout.files),
    )
    if got != layout.sizes:
        raise OSError(f"raw read: file sizes {got} differ from the layout's {layout.sizes}")
    return sum(got)
