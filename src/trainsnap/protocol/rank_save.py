"""One rank's part of a save: describe what it holds, stage it, write what it was assigned.

The protocol around these steps (agreement, plan, commit) is in
:mod:`trainsnap.protocol.save_protocol`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, NamedTuple

import torch

from trainsnap import tunables
from trainsnap.engine.buffers import gather, tensor_bytes
from trainsnap.engine.pool import run_all
from trainsnap.engine.writer import WrittenObject, write_object
from trainsnap.errors import InvalidArgumentError, TrainsnapError
from trainsnap.format import compression, values
from trainsnap.format.checksums import Hasher
from trainsnap.format.layout import SaveLayout, layout_objects
from trainsnap.format.manifest import STATE_KINDS, StoredObject, check_level
from trainsnap.format.values import PickleKeys
from trainsnap.protocol.commit import DIRECT, Committer
from trainsnap.protocol.planner import GLOBAL, Assignment, Entry, RankMeta, Value
from trainsnap.state.capture import Captured, TensorItem, capture
from trainsnap.state.train_state import TrainState
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class SaveOptions:
    """Options of :func:`trainsnap.save`, :func:`trainsnap.async_save` and the manager's saves.

    A :class:`~trainsnap.TrainState` supplies the level, versions and counters itself; the
    fields here add to or override them (:meth:`request`). Raises
    :class:`~trainsnap.InvalidArgumentError` for an unknown level or compression.
    """

    level: str = "strict"
    """The resume level the snapshot offers when the state is a plain mapping (a TrainState
    decides its own: it only offers what it really captured)."""
    tokens_seen: int | None = None
    """Tokens trained on so far, recorded in the manifest and listings."""
    samples_seen: int | None = None
    """Samples trained on so far."""
    data_cursor: Any = None
    """Where the data pipeline is (plain data), checked on a strict resume."""
    versions: Mapping[str, Any] = field(default_factory=dict)
    """User versions (model, tokenizer, code, data, container) a strict resume must match."""
    meta: Mapping[str, Any] = field(default_factory=dict)
    """Free-form plain data kept in the manifest."""
    allow_pickle: PickleKeys = False
    """Store values that are not plain data with pickle: True for all, or the dotted keys whose
    values may be pickled (``("hyper_parameters",)``); loading them needs the same opt-in."""
    checksum: str = "xxh3-128"
    """The block checksum algorithm."""
    compression: str | Mapping[str, str | None] | None = None
    """Lossless compression of tensor data: ``"zstd"``, ``"bytegroup+zstd"``, or a mapping from
    top-level key to either (``{"optim": "bytegroup+zstd"}``). Values are never compressed."""
    chunk_size: int | None = None
    """Object size of large tensors (default: the ``chunk_size`` tunable); smaller chunks make
    incremental snapshots finer-grained (an unchanged chunk is referenced, not rewritten) at
    the cost of more objects."""

    def __post_init__(self) -> None:
        check_level(self.level)
        settings = (
            self.compression.values()
            if isinstance(self.compression, Mapping)
            else [self.compression]
        )
        for setting in settings:
            try:
                compression.codec_for(setting, 4)
            except TrainsnapError as e:
                raise InvalidArgumentError(e.message) from None

    def request(
        self, state: Any, step: int, parts: Collection[str] | None = None
    ) -> tuple[Any, SaveRequest]:
        """The tree to save and what the save records; a :class:`TrainState` gives its tree,
        kinds, level, versions and counters (only ``parts`` of it, when given), which these
        options add to or override. The request holds copies of ``versions`` and ``meta``: an
        asynchronous save records them as they were when it was asked for."""
        if not isinstance(state, TrainState):
            copied = replace(self, versions=dict(self.versions), meta=dict(self.meta))
            return state, SaveRequest(step=step, options=copied)
        tokens, samples = state.counters()
        resolved = replace(
            self,
            level=state.offered_level(parts),
            versions={**state.versions, **self.versions},
            meta=dict(self.meta),
            tokens_seen=tokens if self.tokens_seen is None else self.tokens_seen,
            samples_seen=samples if self.samples_seen is None else self.samples_seen,
            data_cursor=state.data_cursor() if self.data_cursor is None else self.data_cursor,
        )
        request = SaveRequest(step=step, options=resolved, state_kinds=state.kinds(parts))
        return state.save_tree(parts), request


@dataclass(slots=True, kw_only=True)
class SaveRequest:
    """One save: its step, its options as they apply to the state saved (a TrainState's level,
    versions and counters filled in by :meth:`SaveOptions.request`), and the caller's hooks."""

    step: int
    options: SaveOptions = field(default_factory=SaveOptions)
    state_kinds: Mapping[str, bool] = field(default_factory=dict)
    """Which of :data:`~trainsnap.format.manifest.STATE_KINDS` the state holds."""
    fence: Callable[[], None] | None = None
    """Raises when this writer may no longer commit (see :mod:`trainsnap.manager.lease`)."""
    on_commit: Callable[[str, Any, int], None] | None = None
    """Called on every rank once committed, with the snapshot id, the manifest (the
    coordinator's; None elsewhere) and the bytes written (restart log, promotion, retention,
    collection)."""
    committer: Committer = DIRECT
    """How the save commits (:class:`~trainsnap.protocol.commit.Committer`): the manifest then
    the marker into the save's storage, unless a tier commits otherwise."""

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, got {self.step!r}")
        unknown = set(self.state_kinds) - set(STATE_KINDS)
        if unknown:
            raise InvalidArgumentError(
                f"unknown state kinds {sorted(unknown)}; known {STATE_KINDS}"
            )


def stage_tensor(tensor: TensorItem) -> tuple[memoryview, torch.Tensor]:
    """The bytes of a tensor entry and what keeps them alive. A CPU-contiguous tensor is used in
    place (a synchronous save copies nothing); others are copied to contiguous host memory."""
    x = tensor.local.detach()
    if x.is_conj():
        x = x.resolve_conj()
    if x.is_neg():
        x = x.resolve_neg()
    if x.device.type != "cpu":
        x = x.to("cpu")
    if not x.is_contiguous():
        x = x.contiguous()
    return tensor_bytes(x), x


@dataclass(slots=True)
class Local:
    """What this rank holds, described for the plan and ready to write."""

    captured: Captured
    entries: list[Entry]
    values: list[Value]
    value_bytes: list[bytes]
    staged: dict[int, tuple[memoryview, torch.Tensor]] = field(default_factory=dict)
    chunk_size: int | None = None
    compression: str | Mapping[str, str | None] | None = None

    def codec(self, index: int) -> str:
        """The object codec of tensor entry ``i``."""
        setting = self.compression
        if isinstance(setting, Mapping):
            setting = setting.get(self.entries[index].key.split(".", 1)[0])
        return compression.codec_for(setting, self.captured.tensors[index].local.element_size())

    def payload(self, index: int) -> memoryview:
        if index not in self.staged:
            self.staged[index] = stage_tensor(self.captured.tensors[index])
        return self.staged[index][0]

    def meta(self, rank: int, step: int) -> RankMeta:
        return RankMeta.pack(rank, step, self.entries, self.values, self.captured.tree)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries) + sum(len(b) for b in self.value_bytes)


def describe(state: Any, opts: SaveRequest, hasher: Hasher, *, replica_digests: bool) -> Local:
    """Capture the state and describe it. Values are encoded here and unsupported dtypes refused,
    so a state that cannot be saved fails before anything is written. With several ranks, plain
    tensors are hashed so the plan can tell true replicas from per-rank tensors."""
    cap = capture(state)
    options = opts.options
    local = Local(cap, [], [], [], chunk_size=options.chunk_size, compression=options.compression)
    sizes = [t.region.numel * t.local.element_size() for t in cap.tensors]
    digests: dict[int, bytes] = {}
    if replica_digests:
        plain = [i for i, t in enumerate(cap.tensors) if not t.declared]
        digests = dict(zip(plain, _digests(local, plain, sizes, hasher), strict=True))
    for i, t in enumerate(cap.tensors):
        dtype = values.dtype_name(t.local.dtype)
        entry = Entry(t.key, dtype, t.global_shape, t.region, sizes[i], digests.get(i))
        local.entries.append(entry)
    for v in cap.values:
        c, data = values.encode(v.value, v.key, allow_pickle=options.allow_pickle)
        local.value_bytes.append(data)
        local.values.append(Value(v.key, c, hasher.digest(data), len(data)))
    return local


_HASH_BATCH = 8 << 20
"""Bytes of payloads hashed per task when plain tensors are hashed to find replicas."""


def _digests(local: Local, which: list[int], sizes: list[int], hasher: Hasher) -> list[bytes]:
    """Digests of the payloads of tensor entries ``which``, in order, hashed on the I/O threads
    in batches of a few MiB (the hash releases the GIL): this is in the pause of a save."""
    batches: list[list[int]] = [[]]
    size = 0
    for i in which:
        if size >= _HASH_BATCH:
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += sizes[i]

    def digest(batch: list[int]) -> list[bytes]:
        return [hasher.digest(local.payload(i)) for i in batch]

    done = run_all([partial(digest, b) for b in batches if b], tunables.get().io_threads)
    return [d for ds in done for d in ds]


# -- writing --------------------------------------------------------------------------------------


Chunks = list[tuple[int, int, int]]
"""(object index in the report, offset in the object, length) per chunk of one payload."""


class Written(NamedTuple):
    """One payload a rank wrote: which, under which scope, and where its bytes went."""

    item: int
    """Its index in the rank's flattened entries (or in its values)."""
    scope: int
    chunks: Chunks


@dataclass(slots=True)
class WriteReport:
    """What one rank wrote, for the coordinator's manifest (or why it failed)."""

    objects: list[StoredObject] = field(default_factory=list)
    entries: list[Written] = field(default_factory=list)
    """Each tensor entry written."""
    values: list[Written] = field(default_factory=list)
    """Each value written."""
    bytes_new: int = 0
    """Bytes actually written (objects already stored are referenced, not rewritten)."""
    error: str | None = None


def _layout(
    sizes: list[int], codecs: list[str], apart: list[int], chunk_size: int | None
) -> SaveLayout:
    """The objects of a rank's payloads; the payloads ``apart`` (the values every rank reads)
    packed in objects of their own, so that a rank reading them reads no other rank's shards
    (a block is read whole to be verified)."""
    t = tunables.get()
    chunk = chunk_size or t.chunk_size
    cut = partial(layout_objects, chunk_size=chunk, pack_threshold=min(t.pack_threshold, chunk))
    if not apart:
        return cut(sizes, codecs=codecs)
    taken = set(apart)
    rest = [j for j in range(len(sizes)) if j not in taken]
    first = cut([sizes[j] for j in rest], codecs=[codecs[j] for j in rest])
    second = cut([sizes[j] for j in apart], codecs=[codecs[j] for j in apart])
    chunks: list[list[tuple[int, int, int]]] = [[] for _ in sizes]
    objects = first.objects
    for j, cs in zip(rest, first.chunks, strict=True):
        chunks[j] = cs
    shift = len(objects)
    for j, cs in zip(apart, second.chunks, strict=True):
        chunks[j] = [(o + shift, off, n) for o, off, n in cs]
    for obj in second.objects:
        obj.parts = [(apart[p], off, n) for p, off, n in obj.parts]
        objects.append(obj)
    for obj in objects[:shift]:
        obj.parts = [(rest[p], off, n) for p, off, n in obj.parts]
    return SaveLayout(objects, chunks)


def write_assigned(
    storage: Storage, hasher: Hasher, local: Local, assignment: Assignment
) -> WriteReport:
    """Write this rank's assigned entries and values as objects; report their chunks.

    Each object's task takes the bytes of its payloads itself, on the I/O threads: the first
    write starts at once rather than after every tensor of the rank has been looked at."""
    n_entries = len(assignment.entries)
    sizes = [local.entries[i].nbytes for i, _ in assignment.entries]
    sizes += [len(local.value_bytes[i]) for i, _ in assignment.values]
    codecs = [local.codec(i) for i, _ in assignment.entries]
    codecs += ["raw"] * len(assignment.values)
    shared = [n_entries + j for j, (_, scope) in enumerate(assignment.values) if scope == GLOBAL]
    layout = _layout(sizes, codecs, shared, local.chunk_size)

    staging = threading.Lock()  # a tensor cut into several objects is copied (if it must be) once

    def payload(j: int) -> memoryview:
        if j < n_entries:
            with staging:
                return local.payload(assignment.entries[j][0])
        return memoryview(local.value_bytes[assignment.values[j - n_entries][0]])

    def task(index: int) -> WrittenObject:
        obj = layout.objects[index]
        parts = [payload(p)[off : off + n] for p, off, n in obj.parts]
        return write_object(storage, hasher, gather(parts, obj.size), obj.codec)

    batch = getattr(storage, "deferred_dir_sync", None)
    with batch() if batch is not None else contextlib.nullcontext():
        written = run_all(
            [partial(task, i) for i in range(len(layout.objects))], tunables.get().io_threads
        )
    report = WriteReport(objects=[w.manifest_row() for w in written])
    written_now = zip(report.objects, written, strict=True)
    report.bytes_new = sum(obj.stored_bytes for obj, w in written_now if w.written)
    n = len(assignment.entries)
    for j, (i, scope) in enumerate(assignment.entries):
        report.entries.append(Written(i, scope, layout.chunks[j]))
    for j, (i, scope) in enumerate(assignment.values):
        report.values.append(Written(i, scope, layout.chunks[n + j]))
    return report
