"""Lossy compaction of retained history: optimizer state kept at lower precision.

Old snapshots kept for history (``KeepEvery``) are rarely resumed from, and their optimizer
moments are most of their bytes. :func:`quantize_history` rewrites such a snapshot as a new one
at the same step whose floating-point optimizer state is rounded to bfloat16 precision (float32
values with the low 16 mantissa bits cleared, then stored with byte grouping + zstd, which makes
those cleared bytes almost free) and which says so: its manifest lists the rounded keys under
``meta.approximate`` and its level is at most ``training``, so a strict restore refuses it. The
newest snapshot -- the resume point -- is never quantized. Everything else of the snapshot is
referenced, not copied.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainsnap import tunables
from trainsnap.engine.buffers import gather
from trainsnap.engine.read_executor import read_payload
from trainsnap.engine.reader import Reader
from trainsnap.engine.writer import write_object
from trainsnap.errors import InvalidArgumentError
from trainsnap.format.layout import layout_objects
from trainsnap.format.manifest import LEVELS, ManifestBuilder, level_rank
from trainsnap.protocol import commit
from trainsnap.storage.base import Storage

log = logging.getLogger(__name__)


def _round_to_bf16(data: bytes) -> bytes:
    t = torch.frombuffer(bytearray(data), dtype=torch.float32)
    return t.to(torch.bfloat16).to(torch.float32).numpy().tobytes()


def quantize_history(
    storage: Storage, snapshot_id: str, *, prefix: str = "optim.", fence: Any = None
) -> str:
    """Replace ``snapshot_id`` by a copy whose float32 tensors under ``prefix`` hold bfloat16
    precision; returns the new snapshot's id. Refuses the newest snapshot."""
    committed = commit.list_committed(storage)
    if committed and committed[-1].snapshot_id == snapshot_id:
        raise InvalidArgumentError(
            f"{snapshot_id} is the newest snapshot, the resume point: it is never quantized",
            snapshot_id=snapshot_id,
        )
    m = commit.open_snapshot(storage, snapshot_id)
    if m.meta.get("approximate"):
        return snapshot_id
    level = LEVELS[min(level_rank(m.level), level_rank("training"))]
    meta = dict(m.meta)
    b = ManifestBuilder(
        snapshot_id=commit.new_snapshot_id(m.step),
        created=m.created,
        step=m.step,
        level=level,
        algorithm=m.algorithm,
        block_size=m.block_size,
        tokens_seen=m.tokens_seen,
        samples_seen=m.samples_seen,
        data_cursor=m.data_cursor,
        state_kinds=m.state_kinds,
        versions=m.versions,
        topology=m.topology,
        parent=m.snapshot_id,
        meta=meta,
        tree=m.tree,
    )
    reader, rounded = Reader(storage, m), []
    # Every payload (shard or value) is laid out anew: small ones were packed with others, so
    # the rounded moments must not share objects with what they replace. Objects are written
    # one at a time (memory: one object); unchanged ones keep their names and are not rewritten.
    owners: list[tuple[int, bool]] = []  # (payload owner row, rounded?)
    for t, key in enumerate(m.tensor_keys):
        lossy = key.startswith(prefix) and m.tensor_dtypes[t] == "float32"
        owners += [(s, lossy) for s, _ in m.tensor_shards(t)]
        if lossy:
            rounded.append(key)
    base = m.value_chunk_base()
    owners += [(base + v, False) for v in range(len(m.value_keys))]
    knobs = tunables.get()
    sizes = [reader.payload_size(o) for o, _ in owners]
    layout = layout_objects(
        sizes,
        chunk_size=knobs.chunk_size,
        pack_threshold=knobs.pack_threshold,
        codecs=["bg4+zstd" if lossy else "raw" for _, lossy in owners],
    )
    index = []
    for obj in layout.objects:
        parts = []
        for p, off, n in obj.parts:
            owner, lossy = owners[p]
            buf = bytearray(n)
            read_payload(reader, owner, off, off + n, memoryview(buf), f"payload {owner}")
            parts.append(memoryview(_round_to_bf16(bytes(buf)) if lossy else buf))
        w = write_object(storage, m.hasher, gather(parts, obj.size), obj.codec)
        index.append(b.add_stored(w.manifest_row()))
    chunks = [[(index[o], off, n) for o, off, n in cs] for cs in layout.chunks]
    k = 0
    for ti, key in enumerate(m.tensor_keys):
        tnew = b.add_tensor(key, int(m.tensor_ranks[ti]), m.tensor_dtypes[ti], m.tensor_shapes[ti])
        for _s, region in m.tensor_shards(ti):
            b.add_shard(tnew, region, chunks[k])
            k += 1
    for v, key in enumerate(m.value_keys):
        b.add_value(key, int(m.value_ranks[v]), m.value_codecs[v], chunks[k])
        k += 1
    meta["approximate"] = {"keys": rounded, "precision": "bfloat16"}
    new = b.build()
    commit.write_commit(storage, new, writer={"quantized_from": snapshot_id}, fence=fence)
    commit.delete_snapshot(storage, snapshot_id)
    log.info(
        "quantized %s (step %d) into %s: %d bytes -> %d bytes, %d tensor(s) at bfloat16",
        snapshot_id,
        m.step,
        new.snapshot_id,
        m.nbytes,
        new.nbytes,
        len(rounded),
    )
    return new.snapshot_id
