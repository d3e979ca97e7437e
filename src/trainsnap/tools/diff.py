"""What changed between two snapshots, tensor by tensor, and by how much.

For each tensor both snapshots hold (same key, same scope): the largest absolute difference and
the relative norm ``||a - b|| / ||a||``, accumulated in float64 over flat pieces of bounded size
read through the verified load path, so comparing two 100 GB snapshots needs no more memory than
a few pieces. A tensor whose shards reference the very same objects (content addresses, hence
the same bytes: an incremental save that reused them) is reported unchanged without reading a
byte. Keys only in one snapshot are reported added or removed; a tensor whose shape changed
cannot be compared element by element and is reported reshaped; one whose dtype changed is
compared in float64 and reported retyped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import Final

import torch

from trainsnap.format import values
from trainsnap.format.manifest import Manifest
from trainsnap.protocol import commit
from trainsnap.protocol.commit import resolve
from trainsnap.storage import Root, Storage, open_storage
from trainsnap.tools.export import Progress, flat_pieces, read_flat

PIECE_ELEMENTS: Final = 4 << 20
"""Elements compared at once: a few float64 work tensors of this length (32 MiB each) live at a
time, whatever the tensors' size."""

CHANGED: Final = "changed"
UNCHANGED: Final = "unchanged"
ADDED: Final = "added"
REMOVED: Final = "removed"
RETYPED: Final = "retyped"
"""Same shape, another dtype: compared in float64, numbers given."""
RESHAPED: Final = "reshaped"
"""Another shape: no element-wise comparison is meaningful, no numbers."""


@dataclass(frozen=True, slots=True)
class TensorDiff:
    """One tensor's difference from snapshot A to snapshot B.

    ``max_abs`` and ``rel_norm`` (``||a - b|| / ||a||``; ``inf`` when ``a`` is zero and ``b`` is
    not) are given for changed, unchanged and retyped tensors and are None otherwise. ``read``
    says whether data was read: False when the manifests alone decided it.
    """

    key: str
    rank: int
    """-1 for a global tensor; N for rank N's own tensor."""
    status: str
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    max_abs: float | None = None
    rel_norm: float | None = None
    read: bool = False

    @property
    def label(self) -> str:
        return self.key if self.rank < 0 else f"{self.key} [rank {self.rank}]"


Pair = tuple[str, int]


def diff_snapshots(
    root: Root,
    first: str,
    second: str,
    *,
    piece_elements: int = PIECE_ELEMENTS,
    progress: Progress | None = None,
) -> list[TensorDiff]:
    """Compare every tensor of snapshots ``a`` and ``b`` (ids or ``"latest"``) of ``root``;
    one :class:`TensorDiff` per (key, scope), sorted by key."""
    storage = open_storage(root)
    ma = commit.open_snapshot(storage, resolve(storage, first))
    mb = commit.open_snapshot(storage, resolve(storage, second))
    ia, ib = ma.tensor_index(), mb.tensor_index()
    out: list[TensorDiff] = []
    todo: list[tuple[Pair, int, int]] = []
    for pair in sorted(ia.keys() | ib.keys()):
        ta, tb = ia.get(pair), ib.get(pair)
        if ta is None or tb is None:
            out.append(_one_sided(pair, ma, ta, mb, tb))
        elif ma.tensor_shapes[ta] != mb.tensor_shapes[tb]:
            out.append(_diff(pair, RESHAPED, ma, ta, mb, tb))
        elif _same_objects(ma, ta, mb, tb):
            out.append(_diff(pair, UNCHANGED, ma, ta, mb, tb, max_abs=0.0, rel_norm=0.0))
        else:
            todo.append((pair, ta, tb))
    total = sum(_nbytes(ma, ta) + _nbytes(mb, tb) for _, ta, tb in todo)

    def advance(count: int) -> None:
        if progress is not None:
            progress(count, total)

    for pair, ta, tb in todo:
        out.append(_compare(storage, pair, ma, ta, mb, tb, max(1, piece_elements), advance))
    out.sort(key=lambda d: (d.key, d.rank))
    return out


def _nbytes(manifest: Manifest, tensor: int) -> int:
    return prod(manifest.tensor_shapes[tensor]) * values.itemsize(manifest.tensor_dtypes[tensor])


def _diff(
    pair: Pair,
    status: str,
    manifest_a: Manifest,
    tensor_a: int,
    manifest_b: Manifest,
    tensor_b: int,
    *,
    max_abs: float | None = None,
    rel_norm: float | None = None,
    read: bool = False,
) -> TensorDiff:
    return TensorDiff(
        pair[0],
        pair[1],
        status,
        manifest_a.tensor_dtypes[tensor_a],
        manifest_b.tensor_dtypes[tensor_b],
        tuple(manifest_a.tensor_shapes[tensor_a]),
        tuple(manifest_b.tensor_shapes[tensor_b]),
        max_abs,
        rel_norm,
        read,
    )


def _one_sided(
    pair: Pair,
    manifest_a: Manifest,
    tensor_a: int | None,
    manifest_b: Manifest,
    tensor_b: int | None,
) -> TensorDiff:
    if tensor_a is not None:
        return TensorDiff(
            pair[0],
            pair[1],
            REMOVED,
            dtype_a=manifest_a.tensor_dtypes[tensor_a],
            shape_a=tuple(manifest_a.tensor_shapes[tensor_a]),
        )
    assert tensor_b is not None
    return TensorDiff(
        pair[0],
        pair[1],
        ADDED,
        dtype_b=manifest_b.tensor_dtypes[tensor_b],
        shape_b=tuple(manifest_b.tensor_shapes[tensor_b]),
    )


def _layout(manifest: Manifest, tensor: int) -> list[tuple[object, list[tuple[str, int, int]]]]:
    """Each shard's geometry and the (object name, offset, length) of its chunks: equal
    layouts mean equal bytes, since object names are content addresses."""
    out: list[tuple[object, list[tuple[str, int, int]]]] = []
    for s, region in manifest.tensor_shards(tensor):
        chunks = [
            (
                manifest.object_names[int(manifest.chunk_object[c])],
                int(manifest.chunk_offset[c]),
                int(manifest.chunk_length[c]),
            )
            for c in manifest.chunks_of(s)
        ]
        out.append((region, chunks))
    return out


def _same_objects(manifest_a: Manifest, tensor_a: int, manifest_b: Manifest, tensor_b: int) -> bool:
    return manifest_a.tensor_dtypes[tensor_a] == manifest_b.tensor_dtypes[tensor_b] and _layout(
        manifest_a, tensor_a
    ) == _layout(manifest_b, tensor_b)


@dataclass(slots=True)
class _Sums:
    """Running statistics of ``a - b`` over the pieces compared so far."""

    max_abs: float = 0.0
    sq_diff: float = 0.0
    sq_a: float = 0.0
    identical: bool = True

    def add(self, values_a: torch.Tensor, values_b: torch.Tensor) -> None:
        if values_a.dtype == values_b.dtype and torch.equal(_bits(values_a), _bits(values_b)):
            self.sq_a += _sq(_wide(values_a))
            return
        self.identical = False
        fa, fb = _wide(values_a), _wide(values_b)
        # Equal values (inf and inf) and NaN against NaN are no difference; NaN against a
        # number is, and makes the statistics NaN, which is what one wants to see.
        same = (fa == fb) | (torch.isnan(fa) & torch.isnan(fb))
        d = torch.where(same, torch.zeros((), dtype=fa.dtype), fa - fb).abs()
        m = float(d.max())
        if math.isnan(m) or m > self.max_abs:
            self.max_abs = m
        self.sq_diff += float((d * d).sum())
        self.sq_a += _sq(fa)

    def rel_norm(self) -> float:
        if self.sq_a > 0 or math.isnan(self.sq_a):
            return math.sqrt(self.sq_diff) / math.sqrt(self.sq_a)
        return 0.0 if self.sq_diff == 0 else math.inf


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.complex128 if x.is_complex() else torch.float64)


def _sq(f: torch.Tensor) -> float:
    a = f.abs()
    return float((a * a).sum())


def _compare(
    storage: Storage,
    pair: Pair,
    manifest_a: Manifest,
    tensor_a: int,
    manifest_b: Manifest,
    tensor_b: int,
    per: int,
    advance: Callable[[int], None],
) -> TensorDiff:
    da = values.dtype_from_name(manifest_a.tensor_dtypes[tensor_a])
    db = values.dtype_from_name(manifest_b.tensor_dtypes[tensor_b])
    sums = _Sums()
    for start, n in flat_pieces(prod(manifest_a.tensor_shapes[tensor_a]), per):
        xa, xb = torch.empty(n, dtype=da), torch.empty(n, dtype=db)
        read_flat(storage, manifest_a, tensor_a, start, xa)
        read_flat(storage, manifest_b, tensor_b, start, xb)
        sums.add(xa, xb)
        advance(n * (da.itemsize + db.itemsize))
    status = RETYPED if da != db else UNCHANGED if sums.identical else CHANGED
    return _diff(
        pair,
        status,
        manifest_a,
        tensor_a,
        manifest_b,
        tensor_b,
        max_abs=sums.max_abs,
        rel_norm=sums.rel_norm(),
        read=True,
    )


def summary(diffs: list[TensorDiff]) -> dict[str, int]:
    """How many tensors of each status, in a fixed order (zero counts included)."""
    order = (CHANGED, UNCHANGED, ADDED, REMOVED, RETYPED, RESHAPED)
    return {s: sum(d.status == s for d in diffs) for s in order}
