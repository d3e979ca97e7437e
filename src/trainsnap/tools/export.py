"""Export a snapshot's model weights as Hugging Face safetensors, streamed in bounded memory.

A snapshot of a large model does not fit in host memory, and it need not: a safetensors file is
an 8-byte header length, a JSON header (names, dtypes, shapes, byte offsets) and the tensors'
bytes back to back. Everything the header needs is in the manifest, so each file's header is
written first and each tensor's bytes follow in flat pieces of at most :data:`PIECE_BYTES`,
read through the verified load path (:func:`trainsnap.protocol.rank_load.fill` into ``Sharded.flat``
destinations: every block checked, only the blocks of the piece read, any saved sharding) and
converted to the requested dtype piece by piece. Each file is written under a temporary name
and renamed when complete; a sharded export writes its index last, so an interrupted export
never leaves an index naming half-written or stale shards.

The layout is what ``transformers`` writes: ``model.safetensors`` when one file suffices, else
``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json`` mapping each
tensor name to its file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import IO, Final

import torch

from trainsnap.engine.buffers import tensor_bytes
from trainsnap.errors import IncompatibleError, InvalidArgumentError, NotFoundError
from trainsnap.format import values
from trainsnap.format.manifest import Manifest, keys_summary
from trainsnap.protocol import commit
from trainsnap.protocol.commit import resolve
from trainsnap.protocol.rank_load import fill
from trainsnap.state.capture import Sharded
from trainsnap.state.template import targets
from trainsnap.storage import Root, Storage, open_storage

log = logging.getLogger(__name__)

PIECE_BYTES: Final = 64 << 20
"""Most bytes of one tensor held at once (per dtype it is read or written in)."""

DEFAULT_MAX_SHARD_SIZE: Final = "5GB"
"""What ``transformers`` uses by default (decimal units, as Hugging Face counts them)."""

SINGLE_FILE: Final = "model.safetensors"
INDEX_FILE: Final = "model.safetensors.index.json"
_SHARD_RE: Final = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

Progress = Callable[[int, int], None]
"""Called with (bytes just done, total bytes of the whole operation)."""

# The dtype names the safetensors format (and its torch loader) knows.
_ST_DTYPES: Final[dict[torch.dtype, str]] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    **{
        dt: name
        for attr, name in (
            ("uint64", "U64"),
            ("uint32", "U32"),
            ("uint16", "U16"),
            ("float8_e4m3fn", "F8_E4M3"),
            ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
            ("float8_e5m2", "F8_E5M2"),
            ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
        )
        if isinstance(dt := getattr(torch, attr, None), torch.dtype)
    },
}

_DTYPE_ALIASES: Final[dict[str, torch.dtype]] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}

_SIZE_RE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS: Final = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


# -- options --------------------------------------------------------------------------------------


def parse_size(size: int | str) -> int:
    """Bytes from ``2GB`` / ``500MB`` (powers of ten, as Hugging Face counts) or ``1GiB``
    (powers of two) or a plain number of bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        found = _SIZE_RE.match(str(size))
        if not found:
            raise InvalidArgumentError(
                f"size {size!r} is not understood; write e.g. 2GB, 500MB, 1GiB or a byte count"
            )
        unit = (found.group(2) or "").lower()
        scale = _UNITS[unit[:1]] if "i" not in unit else 1 << (10 * "kmgt".index(unit[0]) + 10)
        n = int(float(found.group(1)) * scale)
    if n <= 0:
        raise InvalidArgumentError(f"size must be positive, got {size!r}")
    return n


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The floating dtype to convert to (``bf16``, ``fp16``, ``fp32``), or None to keep."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = _DTYPE_ALIASES.get(dtype.lower())
    if found is None:
        raise InvalidArgumentError(
            f"dtype {dtype!r} is not one of bf16, fp16, fp32 (floating tensors are converted, "
            "others kept)"
        )
    return found


# -- the plan (pure: from the manifest alone) ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExportTensor:
    """One tensor of the export: where it comes from and what it becomes."""

    name: str
    """Its name in the safetensors file (the key with the prefix stripped)."""
    index: int
    """Its row in the manifest's tensor table."""
    shape: tuple[int, ...]
    src: torch.dtype
    dst: torch.dtype

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dst.itemsize


@dataclass(slots=True)
class ExportFile:
    """One safetensors file: its tensors in data order."""

    name: str
    tensors: list[ExportTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def header(self, metadata: dict[str, str]) -> bytes:
        """Header length, JSON header padded with spaces to 8-byte alignment: everything before
        the data, computed from shapes and dtypes alone."""
        doc: dict[str, object] = {"__metadata__": metadata}
        pos = 0
        for t in self.tensors:
            end = pos + t.nbytes
            doc[t.name] = {
                "dtype": _ST_DTYPES[t.dst],
                "shape": list(t.shape),
                "data_offsets": [pos, end],
            }
            pos = end
        raw = json.dumps(doc, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw


@dataclass(slots=True)
class ExportPlan:
    snapshot_id: str
    files: list[ExportFile]
    skipped: list[str] = field(default_factory=list)
    """Rank-scoped tensors under the prefix: each rank's own, with no one global value."""

    @property
    def total_size(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def sharded(self) -> bool:
        return len(self.files) > 1

    def weight_map(self) -> dict[str, str]:
        return {t.name: f.name for f in self.files for t in f.tensors}


def plan_export(
    manifest: Manifest, *, dtype: torch.dtype | None, max_shard_size: int, prefix: str
) -> ExportPlan:
    """Which tensors go to which file, in which dtype; refuses before anything is written."""
    chosen, skipped = _select(manifest, prefix)
    tensors = [_export_tensor(manifest, t, prefix, dtype) for t in chosen]
    _check_dtypes(manifest, tensors)
    groups = _shard(tensors, max_shard_size)
    n = len(groups)
    files = [
        ExportFile(
            SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors",
            # Widest dtypes first: every tensor then starts at a multiple of its item size.
            sorted(g, key=lambda t: (-t.dst.itemsize, t.name)),
        )
        for i, g in enumerate(groups)
    ]
    return ExportPlan(manifest.snapshot_id, files, skipped)


def _select(manifest: Manifest, prefix: str) -> tuple[list[int], list[str]]:
    chosen, skipped = [], []
    for t, key in enumerate(manifest.tensor_keys):
        if not key.startswith(prefix) or key == prefix:
            continue
        if int(manifest.tensor_ranks[t]) >= 0:
            skipped.append(f"{key} (rank {int(manifest.tensor_ranks[t])})")
        else:
            chosen.append(t)
    if not chosen:
        tops = sorted({k.split(".", 1)[0] + "." for k in manifest.tensor_keys})
        raise NotFoundError(
            f"snapshot {manifest.snapshot_id} holds no global tensor whose key starts with "
            f"{prefix!r}; "
            f"its tensors start with {keys_summary(tops)}. Pass --prefix (prefix=) accordingly "
            "('' exports every tensor).",
            snapshot_id=manifest.snapshot_id,
            key=prefix,
        )
    return chosen, skipped


def _export_tensor(
    manifest: Manifest, tensor: int, prefix: str, dtype: torch.dtype | None
) -> ExportTensor:
    src = values.dtype_from_name(manifest.tensor_dtypes[tensor])
    dst = dtype if dtype is not None and src.is_floating_point else src
    name = manifest.tensor_keys[tensor][len(prefix) :]
    return ExportTensor(name, tensor, tuple(manifest.tensor_shapes[tensor]), src, dst)


def _check_dtypes(manifest: Manifest, tensors: list[ExportTensor]) -> None:
    bad = [t for t in tensors if t.dst not in _ST_DTYPES]
    if bad:
        raise IncompatibleError(
            f"snapshot {manifest.snapshot_id}: safetensors has no dtype for {len(bad)} tensor(s): "
            + ", ".join(f"{t.name!r} ({t.dst})" for t in bad[:5])
            + ". Convert floating tensors with --dtype, or leave these out with --prefix.",
            snapshot_id=manifest.snapshot_id,
            key=manifest.tensor_keys[bad[0].index],
        )
    if any(t.name == "__metadata__" for t in tensors):
        raise IncompatibleError(
            f"snapshot {manifest.snapshot_id}: a tensor would be named '__metadata__', which "
            "safetensors "
            "reserves; choose another --prefix",
            snapshot_id=manifest.snapshot_id,
        )


def _shard(tensors: list[ExportTensor], max_size: int) -> list[list[ExportTensor]]:
    """Hugging Face's rule: fill a file in key order until the next tensor would overflow it;
    a tensor larger than the limit gets a file of its own."""
    groups: list[list[ExportTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups


# -- streaming reads ------------------------------------------------------------------------------


def flat_pieces(numel: int, per: int) -> Iterator[tuple[int, int]]:
    """(start, length) of consecutive flat pieces of at most ``per`` elements."""
    for start in range(0, numel, per):
        yield start, min(per, numel - start)


def read_flat(
    storage: Storage, manifest: Manifest, tensor: int, start: int, out: torch.Tensor
) -> None:
    """Fill ``out`` (1-D, the tensor's dtype, contiguous CPU) with elements
    ``[start, start + len(out))`` of tensor row ``t``, through the verified load path: only the
    blocks under the range are read, each checked, whatever the saved sharding."""
    key, rank = manifest.tensor_keys[tensor], int(manifest.tensor_ranks[tensor])
    dest = Sharded.flat(out, global_shape=manifest.tensor_shapes[tensor], start=start)
    fill(storage, manifest, targets({key: dest}), max(rank, 0), allow_pickle=False)


def _stream_tensor(
    storage: Storage,
    manifest: Manifest,
    tensor: ExportTensor,
    file: IO[bytes],
    piece_bytes: int,
    progress: Callable[[int], None],
) -> None:
    per = max(1, piece_bytes // max(tensor.src.itemsize, tensor.dst.itemsize))
    buf = torch.empty(min(per, tensor.numel), dtype=tensor.src)
    for start, n in flat_pieces(tensor.numel, per):
        piece = buf[:n]
        read_flat(storage, manifest, tensor.index, start, piece)
        data = piece if tensor.dst == tensor.src else piece.to(tensor.dst)
        file.write(tensor_bytes(data))
        progress(n * tensor.dst.itemsize)


# -- writing --------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_CREATE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _write_atomic(final: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write through a temporary name in the same directory, fsync, rename: a reader sees the
    whole file or none (or the previous one). The temporary name is random (not guessable from
    the pid) and created exclusively without following links (``O_EXCL | O_NOFOLLOW``), both
    relative to the directory opened once, so a link or file planted there is never written
    through; the rename replaces the entry itself, never what a link at ``final`` points to."""
    directory = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    tmp = f".{final.name}.tmp-{secrets.token_hex(8)}"
    try:
        fd = os.open(tmp, _CREATE, 0o644, dir_fd=directory)
        try:
            with os.fdopen(fd, "wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final.name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=directory)
            raise
    finally:
        os.close(directory)


def _write_file(
    storage: Storage,
    manifest: Manifest,
    f: ExportFile,
    out_dir: Path,
    piece_bytes: int,
    progress: Callable[[int], None],
) -> None:
    header = f.header({"format": "pt", "trainsnap.snapshot": manifest.snapshot_id})

    def write(file: IO[bytes]) -> None:
        file.write(header)
        for t in f.tensors:
            _stream_tensor(storage, manifest, t, file, piece_bytes, progress)
        if file.tell() != len(header) + f.nbytes:
            raise AssertionError(f"{f.name}: wrote {file.tell()} bytes, planned more or less")

    _write_atomic(out_dir / f.name, write)


def _write_index(plan: ExportPlan, out_dir: Path) -> None:
    doc = {"metadata": {"total_size": plan.total_size}, "weight_map": plan.weight_map()}
    data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
    _write_atomic(out_dir / INDEX_FILE, lambda fh: fh.write(data))


def _remove_entry_points(out_dir: Path, plan: ExportPlan) -> list[str]:
    """Before writing: delete a previous export's index (and its single file when this export
    is sharded), so that while shards are replaced one by one no loader finds an index that
    mixes old and new files. A single file is left to be replaced by one atomic rename."""
    doomed = [INDEX_FILE, *([SINGLE_FILE] if plan.sharded else [])]
    removed = [name for name in doomed if (out_dir / name).exists()]
    for name in removed:
        (out_dir / name).unlink(missing_ok=True)
    return removed


def _remove_stale_shards(out_dir: Path, plan: ExportPlan) -> list[str]:
    """After writing: delete shard files of a previous export that this one did not write."""
    keep = {f.name for f in plan.files}
    removed = [p.name for p in out_dir.iterdir() if _SHARD_RE.match(p.name) and p.name not in keep]
    for name in removed:
        (out_dir / name).unlink(missing_ok=True)
    return removed


def _new_directories(out: Path) -> list[Path]:
    """The directories ``out.mkdir(parents=True)`` will create, deepest first."""
    missing = []
    for path in (out, *out.parents):
        if path.exists() or path.is_symlink():
            break
        missing.append(path)
    return missing


def _undo(out: Path, written: list[str], made: list[Path]) -> None:
    """After a failed export: remove the files it wrote and the directories it made (a file
    it replaced is gone either way; the index was removed first, so no loader finds a mix)."""
    for name in written:
        with contextlib.suppress(FileNotFoundError):
            (out / name).unlink()
    for directory in made:
        with contextlib.suppress(OSError):
            directory.rmdir()  # only when empty


def export_safetensors(
    root: Root,
    snapshot_id: str,
    out_dir: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    prefix: str = "model.",
    piece_bytes: int = PIECE_BYTES,
    progress: Progress | None = None,
) -> Path:
    """Write the global tensors of ``snapshot_id`` (or ``"latest"``) whose keys start with
    ``prefix`` as Hugging Face safetensors in ``out_dir``, names stripped of the prefix,
    floating tensors converted to ``dtype`` when given. Returns the file a loader opens: the
    index of a sharded export, else ``model.safetensors``.

    Memory stays bounded by ``piece_bytes`` per dtype whatever the model size. Rank-scoped
    tensors (each rank's own) have no single value to export and are skipped with a warning.
    """
    storage = open_storage(root)
    m = commit.open_snapshot(storage, resolve(storage, snapshot_id))
    plan = plan_export(
        m, dtype=parse_dtype(dtype), max_shard_size=parse_size(max_shard_size), prefix=prefix
    )
    if plan.skipped:
        log.warning(
            "export of snapshot %s skips %d rank-scoped tensor(s) (each rank's own, no single "
            "value): %s",
            m.snapshot_id,
            len(plan.skipped),
            keys_summary(plan.skipped),
        )
    return write_export(storage, m, plan, out_dir, piece_bytes=piece_bytes, progress=progress)


def write_export(
    storage: Storage,
    manifest: Manifest,
    plan: ExportPlan,
    out_dir: str | os.PathLike[str],
    *,
    piece_bytes: int = PIECE_BYTES,
    progress: Progress | None = None,
) -> Path:
    """Write the files of ``plan`` (see :func:`export_safetensors`); separate from planning so
    that a caller can show the plan (files, sizes, skipped tensors) and report it itself."""
    if piece_bytes <= 0:
        raise InvalidArgumentError(f"piece_bytes must be positive, got {piece_bytes}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(
            f"export destination {out} exists and is not a directory; give a new or existing "
            "directory",
            path=str(out),
        )
    made = _new_directories(out)
    out.mkdir(parents=True, exist_ok=True)
    removed = _remove_entry_points(out, plan)
    total = plan.total_size

    def advance(count: int) -> None:
        if progress is not None:
            progress(count, total)

    written: list[str] = []
    try:
        for f in plan.files:
            _write_file(storage, manifest, f, out, piece_bytes, advance)
            written.append(f.name)
        if plan.sharded:
            _write_index(plan, out)
    except BaseException:
        _undo(out, written, made)
        raise
    removed += _remove_stale_shards(out, plan)
    _fsync_dir(out)
    for directory in made:  # deepest first: each new directory's entry lives in its parent
        _fsync_dir(directory.parent)
    if removed:
        log.info("removed files of a previous export from %s: %s", out, ", ".join(removed))
    log.info(
        "exported snapshot %s: %d tensors, %d bytes in %d file(s) to %s",
        manifest.snapshot_id,
        sum(len(f.tensors) for f in plan.files),
        total,
        len(plan.files),
        out,
    )
    return out / (INDEX_FILE if plan.sharded else SINGLE_FILE)
