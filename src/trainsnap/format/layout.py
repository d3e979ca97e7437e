"""Planning what goes where: pure functions on sizes, no data, no I/O.

Save side: :func:`layout_objects` cuts each payload (a shard's bytes or an encoded value) into
chunks and assigns chunks to objects -- a large payload gets objects of its own, ``chunk_size``
bytes each; small payloads are packed together so that two thousand biases do not become two
thousand files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class ObjectLayout:
    """One object to write: the concatenation of ``parts``, each (payload, offset, length)."""

    parts: list[tuple[int, int, int]] = field(default_factory=list)
    size: int = 0
    codec: str = "raw"


@dataclass(slots=True)
class SaveLayout:
    objects: list[ObjectLayout]
    chunks: list[list[tuple[int, int, int]]]
    """Per payload, its chunks in order: (object index, offset in object, length)."""


def layout_objects(
    sizes: list[int],
    *,
    chunk_size: int,
    pack_threshold: int,
    codecs: Sequence[str] | None = None,
) -> SaveLayout:
    """Assign payloads of the given byte sizes to objects.

    Payloads of at least ``pack_threshold`` bytes are cut at multiples of ``chunk_size`` into
    objects of their own (so unchanged regions of a large tensor keep their object names from one
    snapshot to the next); smaller payloads fill pack objects of up to ``chunk_size`` bytes in
    the order given (callers pass related payloads together). Payloads are only packed with
    payloads of the same codec (``codecs``, default all raw): an object has one codec.
    """
    assert chunk_size > 0 and pack_threshold >= 0
    objects: list[ObjectLayout] = []
    chunks: list[list[tuple[int, int, int]]] = [[] for _ in sizes]
    packs: dict[str, tuple[ObjectLayout, int]] = {}
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        codec = codecs[i] if codecs is not None else "raw"
        if n >= pack_threshold:
            for off in range(0, n, chunk_size):
                length = min(chunk_size, n - off)
                chunks[i].append((len(objects), 0, length))
                objects.append(ObjectLayout([(i, off, length)], length, codec))
            continue
        pack, pack_index = packs.get(codec, (None, -1))
        if pack is None or pack.size + n > chunk_size:
            pack, pack_index = ObjectLayout(codec=codec), len(objects)
            packs[codec] = (pack, pack_index)
            objects.append(pack)
        chunks[i].append((pack_index, pack.size, n))
        pack.parts.append((i, 0, n))
        pack.size += n
    return SaveLayout(objects, chunks)
