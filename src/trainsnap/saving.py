"""Saving one process's state: capture, stage, write objects, build the manifest, commit."""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from typing import Any

import torch

from . import codec, tunables
from ._version import __version__ as _version
from .capture import Captured, capture
from .checksum import Hasher
from .commit import new_snapshot_id, write_commit
from .engine import WrittenObject, gather, run_all, tensor_bytes, write_object
from .errors import InvalidArgumentError
from .manifest import LEVELS, STATE_KINDS, Manifest, ManifestBuilder
from .plan import SaveLayout, layout_objects
from .spec import Region, Shape, tiling_problems
from .storage.base import Storage

log = logging.getLogger("trainsnap.save")


@dataclass(slots=True, kw_only=True)
class SaveOptions:
    """What a save records beyond the state itself."""

    step: int
    level: str = "strict"
    """The resume level this snapshot can give (what the state held)."""
    tokens_seen: int | None = None
    samples_seen: int | None = None
    data_cursor: Any = None
    state_kinds: Mapping[str, bool] = field(default_factory=dict)
    user_versions: Mapping[str, Any] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)
    allow_pickle: bool = False
    checksum: str = "xxh3-128"

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, got {self.step!r}")
        if self.level not in LEVELS:
            raise InvalidArgumentError(f"level must be one of {LEVELS}, got {self.level!r}")
        unknown = set(self.state_kinds) - set(STATE_KINDS)
        if unknown:
            raise InvalidArgumentError(
                f"unknown state kinds {sorted(unknown)}; known {STATE_KINDS}"
            )


@dataclass(slots=True)
class Staged:
    """Payload bytes ready to write, and what keeps them alive."""

    captured: Captured
    payloads: list[memoryview]
    codecs: list[str]
    keepalive: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.payloads)


def stage(cap: Captured, *, allow_pickle: bool) -> Staged:
    """Bytes of every entry. CPU-contiguous tensors are used in place (a synchronous save does
    not copy them); others are copied to contiguous host memory. Values are encoded here, so a
    value that cannot be saved fails before anything is written."""
    payloads, keep, codecs = [], [], []
    for t in cap.tensors:
        codec.dtype_name(t.local.dtype)  # refuse unsupported dtypes before writing anything
        x = t.local.detach()
        if x.is_conj():
            x = x.resolve_conj()
        if x.is_neg():
            x = x.resolve_neg()
        if x.device.type != "cpu":
            x = x.to("cpu")
        if not x.is_contiguous():
            x = x.contiguous()
        keep.append(x)
        payloads.append(tensor_bytes(x))
    for v in cap.values:
        c, data = codec.encode(v.value, v.key, allow_pickle=allow_pickle)
        codecs.append(c)
        payloads.append(memoryview(data))
    return Staged(cap, payloads, codecs, keep)


def write_payloads(
    storage: Storage, hasher: Hasher, payloads: list[memoryview], threads: int
) -> tuple[SaveLayout, list[WrittenObject]]:
    t = tunables.get()
    layout = layout_objects(
        [len(p) for p in payloads], chunk_size=t.chunk_size, pack_threshold=t.pack_threshold
    )

    def task(i: int) -> WrittenObject:
        obj = layout.objects[i]
        parts = [payloads[p][off : off + n] for p, off, n in obj.parts]
        return write_object(storage, hasher, gather(parts, obj.size))

    written = run_all([partial(task, i) for i in range(len(layout.objects))], threads)
    return layout, written


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def library_versions(user: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "user": dict(user),
        "trainsnap": _version,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def build_manifest(
    snapshot_id: str,
    opts: SaveOptions,
    hasher: Hasher,
    staged: Staged,
    layout: SaveLayout,
    written: list[WrittenObject],
    topology: Mapping[str, Any],
) -> Manifest:
    b = ManifestBuilder(
        snapshot_id=snapshot_id,
        created=now_iso(),
        step=opts.step,
        level=opts.level,
        algorithm=hasher.algorithm,
        block_size=hasher.block_size,
        tokens_seen=opts.tokens_seen,
        samples_seen=opts.samples_seen,
        data_cursor=opts.data_cursor,
        state_kinds={k: bool(opts.state_kinds.get(k, False)) for k in STATE_KINDS},
        versions=library_versions(opts.user_versions),
        topology=dict(topology),
        meta=dict(opts.meta),
    )
    index = [b.add_object(w.name, w.size, w.digests) for w in written]
    cap = staged.captured
    for i, t in enumerate(cap.tensors):
        ti = b.add_tensor(t.key, t.rank, codec.dtype_name(t.local.dtype), t.global_shape)
        b.add_shard(ti, t.region, [(index[o], off, n) for o, off, n in layout.chunks[i]])
    base = len(cap.tensors)
    for j, v in enumerate(cap.values):
        chunks = [(index[o], off, n) for o, off, n in layout.chunks[base + j]]
        b.add_value(v.key, v.rank, staged.codecs[j], chunks)
    return b.build()


def check_tiling(key: str, regions: list[Region], shape: Shape) -> None:
    """Refuse, before anything is written, a tensor whose saved shards do not tile it."""
    problems = tiling_problems(regions, shape)
    if problems:
        raise InvalidArgumentError(
            f"the shards of {key!r} (global shape {list(shape)}) saved by all ranks together "
            "do not cover it exactly once: every element must be saved by exactly one shard "
            "(replicas are fine). Check the offsets / starts given to ts.Sharded.",
            key=key,
            problems=problems,
        )


def save_local(state: Any, storage: Storage, opts: SaveOptions) -> Manifest:
    """The whole save of a single process (no process group)."""
    t0 = time.perf_counter()
    hasher = Hasher(opts.checksum, tunables.get().block_size)
    cap = capture(state)
    for t in cap.tensors:
        check_tiling(t.key, [t.region], t.global_shape)
    staged = stage(cap, allow_pickle=opts.allow_pickle)
    sid = new_snapshot_id(opts.step)
    layout, written = write_payloads(storage, hasher, staged.payloads, tunables.get().io_threads)
    topology = {"world_size": 1, "coordinator": 0, "mesh": {}}
    manifest = build_manifest(sid, opts, hasher, staged, layout, written, topology)
    write_commit(storage, manifest, writer={"world_size": 1})
    dt = time.perf_counter() - t0
    nbytes = staged.nbytes
    new = sum(w.size for w in written if w.written)
    log.info(
        "saved snapshot %s step=%d bytes=%d written=%d objects=%d seconds=%.3f MBps=%.1f root=%s",
        sid, opts.step, nbytes, new, len(written), dt, nbytes / max(dt, 1e-9) / 1e6, storage.url,
    )  # fmt: skip
    return manifest
