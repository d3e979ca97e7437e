"""From user state to entries, and back.

Saving walks the state and yields one :class:`TensorItem` per tensor leaf and one
:class:`ValueItem` per plain leaf, keyed by the dotted path of dict keys and list indices
(``model.layers.0.weight``, ``optimizer.param_groups``). Objects with ``state_dict()`` and
``load_state_dict()`` are walked through their state dict. Dicts are always walked; a list or
tuple is walked when it holds a tensor somewhere and is a plain value otherwise.

Loading walks the *given* state the same way, once per load (:mod:`trainsnap.state.template`):
tensors to fill in place, containers to put plain values into, and each stateful object, which
gets its state dict back through ``load_state_dict`` after filling.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import OrderedDict
from collections.abc import (
    Callable,
    Collection,
    Iterator,
    Mapping,
    MutableMapping,
    MutableSequence,
)
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch

from trainsnap.errors import InvalidArgumentError
from trainsnap.format import tree as tree_mod
from trainsnap.format import values as values_mod
from trainsnap.format.regions import Box, Flat, Region, Shape

GLOBAL = -1
"""Rank scope of an entry that is the same for every rank (stored once)."""


class Sharded:
    """A local piece of a logical tensor that the caller lays out by hand.

    ``Sharded(local, global_shape=(8192, 4096), offsets=(2048, 0))`` is a box (a Megatron TP
    slice, a pipeline stage's layer, an expert by its global id); ``Sharded.flat(buf,
    global_shape=(8192, 4096), start=n)`` is a flat range of the row-major flattening (a ZeRO or
    distributed-optimizer buffer). Loading fills ``local`` in place.
    """

    __slots__ = ("global_shape", "local", "region")

    def __init__(
        self,
        local: torch.Tensor,
        *,
        global_shape: tuple[int, ...] | torch.Size,
        offsets: tuple[int, ...] | None = None,
        region: Region | None = None,
    ) -> None:
        if not isinstance(local, torch.Tensor):
            raise InvalidArgumentError(f"Sharded needs a tensor, got {type(local).__name__}")
        self.local = local
        self.global_shape: Shape = tuple(int(n) for n in global_shape)
        if region is None:
            if offsets is None:
                offsets = (0,) * len(self.global_shape)
            region = Box(tuple(int(o) for o in offsets), tuple(local.shape))
        self.region = region
        if isinstance(region, Box) and tuple(local.shape) != region.sizes:
            raise InvalidArgumentError(
                f"Sharded: local shape {tuple(local.shape)} differs from the box sizes "
                f"{region.sizes}"
            )
        if isinstance(region, Flat) and (local.dim() != 1 or local.numel() != region.length):
            raise InvalidArgumentError(
                f"Sharded.flat: local must be 1-D with {region.length} elements, "
                f"got shape {tuple(local.shape)}"
            )
        region.check(self.global_shape)

    @classmethod
    def flat(
        cls, local: torch.Tensor, *, global_shape: tuple[int, ...] | torch.Size, start: int
    ) -> Sharded:
        return cls(local, global_shape=global_shape, region=Flat(int(start), local.numel()))

    def __repr__(self) -> str:
        return f"Sharded({self.region}, global_shape={self.global_shape}, dtype={self.local.dtype})"


@dataclass(slots=True)
class TensorItem:
    key: str
    local: torch.Tensor
    global_shape: Shape
    region: Region
    rank: int = GLOBAL
    """``GLOBAL`` for part of a logical tensor; a rank number for a rank's own tensor."""
    declared: bool = False
    """True when the layout was declared (``DTensor``, :class:`Sharded`): ranks holding the same
    region hold replicas by declaration. A plain tensor on several ranks is only taken as a
    replica if its bytes are identical everywhere."""


@dataclass(slots=True)
class ValueItem:
    key: str
    value: Any
    rank: int = GLOBAL


@dataclass(slots=True)
class ValueTarget:
    key: str
    container: MutableMapping[Any, Any] | MutableSequence[Any] | None
    index: Any


@dataclass(slots=True)
class Captured:
    tensors: list[TensorItem] = field(default_factory=list)
    values: list[ValueItem] = field(default_factory=list)
    mesh: dict[str, int] = field(default_factory=dict)
    """Dimension names and sizes of the device mesh of the state's DTensors, if any."""
    tree: Any = None
    """The state's structure (:mod:`trainsnap.format.tree`)."""


@dataclass(slots=True)
class Targets:
    tensors: list[TensorItem] = field(default_factory=list)
    values: list[ValueTarget] = field(default_factory=list)
    finishers: list[Callable[[], None]] = field(default_factory=list)
    """Run in order after filling: ``load_state_dict`` of each stateful object, innermost first."""
    assign: Callable[[dict[str, Any]], None] | None = None
    """When set, puts the decoded values (by key) and created tensors in place, instead of
    each value target's container (loads driven by the saved tree)."""
    left_out: list[str] = field(default_factory=list)
    """Saved keys an :class:`Exact` mapping did not admit (another rank may hold them)."""
    admitted: list[str] = field(default_factory=list)
    """Saved keys an :class:`Exact` mapping admitted."""


class Exact(dict):  # type: ignore[type-arg]
    """A mapping of a load's template whose keys -- or ``allowed``, when given -- are all that
    loading into it may fill: keys the snapshot holds there beyond them are left out, not
    added (a dict with fewer keys is otherwise a placeholder, completed from the snapshot).
    ``allowed`` also lets keys the template lacks be completed: an optimizer's state, empty
    before its first step, gets the moments of its own parameters and no others. A pipeline
    stage's model and optimizer state are exact: the stages of a job saved one tree holding
    every stage's keys, and a stage holds only its own."""

    def __init__(self, items: Any = (), allowed: Collection[Any] | None = None) -> None:
        super().__init__(items)
        self.allowed = None if allowed is None else frozenset(allowed)


def is_stateful(obj: object) -> bool:
    return (
        not isinstance(obj, torch.Tensor | Mapping)
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def state_dict_of(obj: Any, key: str) -> Mapping[Any, Any]:
    """``obj.state_dict()``, which must be a mapping (``key``: where ``obj`` sits)."""
    sd = obj.state_dict()
    if not isinstance(sd, Mapping):
        raise InvalidArgumentError(
            f"{key or 'state'}: {type(obj).__name__}.state_dict() returned "
            f"{type(sd).__name__}, not a mapping",
            key=key,
        )
    return sd


def has_tensor(obj: object, active: tuple[int, ...] = ()) -> bool:
    """Whether a tensor or a stateful object is under ``obj``. A container that holds itself
    counts as one (the walk then reaches the cycle and refuses it); past the deepest nesting a
    plain value may have, False (the value's encoder refuses it)."""
    if isinstance(obj, torch.Tensor | Sharded):
        return True
    if isinstance(obj, Mapping | list | tuple):
        if id(obj) in active:
            return True
        if len(active) > values_mod.MAX_DEPTH:
            return False
        inner = (*active, id(obj))
        children = obj.values() if isinstance(obj, Mapping) else obj
        return any(has_tensor(v, inner) for v in children)
    return is_stateful(obj)


def _described(key: object) -> str:
    if isinstance(key, int) and not -tree_mod.MAX_INT < key < tree_mod.MAX_INT:
        return f"(an integer of {key.bit_length()} bits)"
    text = repr(key)
    return text if len(text) <= 60 else f"{text[:57]}..."


def join_key(prefix: str, key: object) -> str:
    if type(key) is str and key:  # the common case, first: this runs for every entry
        return f"{prefix}.{key}" if prefix else key
    if not tree_mod.is_key(key):
        raise InvalidArgumentError(
            f"state key {_described(key)} under {prefix[:80] or 'the root'!r} is a "
            f"{type(key).__name__}; keys must be str, int (below 2^1024 in size), float, bool "
            "or None",
            key=prefix,
        )
    part = tree_mod.part(key)  # type: ignore[arg-type]
    if part == "":
        raise InvalidArgumentError(f"empty key under {prefix or 'the root'!r}", key=prefix)
    return f"{prefix}.{part}" if prefix else part


def leaf_item(key: str, leaf: torch.Tensor | Sharded, boxes: DTensorBoxes) -> TensorItem:
    """The entry of a tensor leaf (a tensor, a DTensor or a :class:`Sharded`)."""
    if isinstance(leaf, Sharded):
        return TensorItem(key, leaf.local, leaf.global_shape, leaf.region, declared=True)
    return _leaf_tensor(key, leaf, boxes)


def _leaf_tensor(key: str, tensor: torch.Tensor, boxes: DTensorBoxes) -> TensorItem:
    if _is_dtensor(tensor):
        return boxes.item(key, tensor)
    if hasattr(tensor, "global_offsets") and _is_checkpointable(tensor):
        return _checkpointable_item(key, tensor)
    shape = tuple(tensor.shape)
    return TensorItem(key, tensor, shape, Box.full(shape))


@cache
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch.distributed not built in
        return None
    return DTensor


def _is_dtensor(tensor: torch.Tensor) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(tensor, cls)


@cache
def _checkpointable_type() -> type | None:
    try:
        from torch.distributed import checkpoint
    except ImportError:  # torch.distributed not built in
        return None
    protocol = getattr(checkpoint, "CheckpointableTensor", None)  # torch 2.14+
    return protocol if isinstance(protocol, type) else None


def _is_checkpointable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` carries DCP's ``CheckpointableTensor`` fields, on a torch that defines
    them (2.14+; on older torch such attributes mean nothing and the tensor is a plain one)."""
    cls = _checkpointable_type()
    return cls is not None and isinstance(tensor, cls)


def _checkpointable_item(key: str, tensor: Any) -> TensorItem:
    """The entry of a ``CheckpointableTensor``: a plain tensor whose one shard,
    ``tensor[local_offsets : local_offsets + local_sizes]``, is the box at ``global_offsets``
    of a logical tensor of ``global_shape`` -- what ``Sharded(shard, global_shape=...,
    offsets=global_offsets)`` declares. Loading fills the shard in place (the rest of the
    tensor, e.g. padding, is left as it is). Raises :class:`InvalidArgumentError` (naming the
    key) for more or fewer than one shard and for fields that do not fit. O(dimensions)."""
    fields = (tensor.global_offsets, tensor.local_offsets, tensor.local_sizes)
    if any(len(field) != 1 for field in fields):
        raise InvalidArgumentError(
            f"{key!r}: CheckpointableTensor with {len(tensor.global_offsets)} shards (and "
            f"{len(tensor.local_offsets)} local offsets, {len(tensor.local_sizes)} local sizes); "
            "trainsnap takes one box of a tensor per rank: give this rank's piece as one shard "
            "(or as ts.Sharded, or a DTensor)",
            key=key,
        )
    global_shape = tuple(int(n) for n in tensor.global_shape)
    offsets, local_offsets, sizes = (tuple(int(n) for n in field[0]) for field in fields)
    local_shape = tuple(tensor.shape)
    for start, shape, where in (
        (offsets, global_shape, "global shape"),
        (local_offsets, local_shape, "local tensor"),
    ):
        if len(start) != len(shape) or len(sizes) != len(shape):
            raise InvalidArgumentError(
                f"{key!r}: CheckpointableTensor shard at {start} of size {sizes} does not have "
                f"the {len(shape)} dimensions of the {where} {shape}; give global_offsets, "
                "local_offsets and local_sizes one entry per dimension",
                key=key,
            )
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(start, sizes, shape, strict=True)):
            raise InvalidArgumentError(
                f"{key!r}: CheckpointableTensor shard at {start} of size {sizes} lies outside "
                f"the {where} {shape}; fix its global_offsets, local_offsets or local_sizes",
                key=key,
            )
    local = tensor
    if local_shape != sizes:
        # The shard as a view: loading fills it in place (no autograd view of a parameter).
        index = tuple(slice(o, o + n) for o, n in zip(local_offsets, sizes, strict=True))
        with torch.no_grad():
            local = tensor[index]
    return TensorItem(key, local, global_shape, Box(offsets, sizes), declared=True)


_BoxKey = tuple[tuple[int, ...], tuple[Any, ...]]
_BOXES: weakref.WeakKeyDictionary[Any, dict[_BoxKey, Box]] = weakref.WeakKeyDictionary()
"""This process's boxes by device mesh, then (global shape, placements): a mesh's coordinates
never change, so a box once worked out holds for every later walk, save and load alike. Keyed
weakly: a mesh dropped by the job takes its boxes with it."""


class DTensorBoxes:
    """DTensor local shards as boxes of their global tensors.

    ``Shard(d)``, ``Replicate()`` and the ``_StridedShard`` of FSDP2 over tensor parallelism, in
    any mix, uneven shards included; the box is torch's own
    (``compute_local_shape_and_global_offset``, as DCP uses). It is worked out once per mesh,
    global shape and placements and process: a model's layers share a handful of layouts, and
    torch's computation with its placement checks is Python and tensor work per call (it makes
    small tensors, which wait for the intra-op threads) that every save and every load would
    otherwise pay for each DTensor before its first byte moves (docs/PERFORMANCE.md has the
    figures). O(distinct layouts) calls to torch a process; O(1) dictionary lookups a tensor."""

    def item(self, key: str, tensor: Any) -> TensorItem:
        mesh, placements, shape = tensor.device_mesh, tuple(tensor.placements), tuple(tensor.shape)
        try:
            known = _BOXES.get(mesh)
            box = None if known is None else known.get((shape, placements))
        except TypeError:  # a mesh or placement that cannot be hashed: not remembered
            box = self._box(key, mesh, placements, shape)
        else:
            if box is None:
                box = self._box(key, mesh, placements, shape)
                with contextlib.suppress(TypeError):
                    _BOXES.setdefault(mesh, {})[(shape, placements)] = box
        # Without autograd, to_local is the local tensor itself, not a differentiable view (an
        # autograd function call per tensor); loading fills it in place, saving reads it.
        with torch.no_grad():
            local = tensor.to_local()
        if box.sizes != tuple(local.shape):
            raise InvalidArgumentError(
                f"{key!r}: DTensor local shard has shape {tuple(local.shape)}, expected "
                f"{box.sizes} from its placements",
                key=key,
            )
        return TensorItem(key, local, shape, box, declared=True)

    @staticmethod
    def _box(key: str, mesh: Any, placements: tuple[Any, ...], shape: tuple[int, ...]) -> Box:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _check_placements(key, placements, tuple(mesh.shape))
        sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
        return Box(tuple(offsets), tuple(sizes))


def _check_placements(key: str, placements: Any, mesh_shape: tuple[int, ...]) -> None:
    """Refuse what does not make each rank's piece one box, naming the key and the fix."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for i, placement in enumerate(placements):
        if isinstance(placement, Partial):
            raise InvalidArgumentError(
                f"{key!r}: DTensor placement {placement} holds partial sums, not values; reduce "
                "it first, e.g. t.redistribute(placements=[Replicate()]) (or Shard(d))",
                key=key,
            )
        if isinstance(placement, _StridedShard):
            # FSDP2 over TP: a box exactly when the later mesh dimensions that shard the same
            # tensor dimension split it split_factor ways (the strides then tile the piece).
            later = [
                mesh_shape[j]
                for j in range(i + 1, len(placements))
                if isinstance(placements[j], Shard | _StridedShard)
                and placements[j].dim == placement.dim
            ]
            if math.prod(later) != placement.split_factor:
                raise InvalidArgumentError(
                    f"{key!r}: DTensor placements {tuple(placements)} on mesh {mesh_shape} make "
                    "each rank's piece a set of strided rows, not a box; redistribute it to "
                    "Shard/Replicate placements before saving",
                    key=key,
                )
        elif not isinstance(placement, Shard | Replicate):
            raise InvalidArgumentError(
                f"{key!r}: DTensor placement {placement} is not supported (Shard, Replicate and "
                "FSDP2's _StridedShard are); redistribute it to Shard/Replicate placements",
                key=key,
            )


def mesh_of(tensor: Any) -> dict[str, int]:
    """Dimension names and sizes of a DTensor's device mesh (recorded in the manifest)."""
    mesh = tensor.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return {str(n): int(s) for n, s in zip(names, mesh.shape, strict=True)}


def _walk(
    obj: Any,
    key: str,
    visit: Callable[[str, Any, Any, Any], None],
    parent: Any,
    idx: Any,
    depth: int = 0,
) -> Any:
    """Visit every leaf under ``obj``; returns the structure (a :mod:`~trainsnap.format.tree`
    node) of what was walked. A structure nested deeper than a reader reads (which a cycle
    always is) is refused here, before anything is written."""
    if isinstance(obj, torch.Tensor | Sharded):
        visit(key, obj, parent, idx)
        return tree_mod.LEAF
    if depth > tree_mod.MAX_DEPTH and (is_stateful(obj) or isinstance(obj, Mapping | list | tuple)):
        raise InvalidArgumentError(
            f"cannot save {key[:80]!r}: the state is nested deeper than {tree_mod.MAX_DEPTH} "
            "containers there (or holds itself), which no reader reads back; flatten it or "
            "break the cycle",
            key=key[:200],
        )
    if is_stateful(obj):
        return _walk_mapping(state_dict_of(obj, key), key, visit, depth)
    if isinstance(obj, Mapping):
        return _walk_mapping(obj, key, visit, depth)
    if isinstance(obj, list | tuple) and has_tensor(obj):
        children = [_walk(v, join_key(key, i), visit, obj, i, depth + 1) for i, v in enumerate(obj)]
        return tree_mod.sequence(tree_mod.container_kind(obj), children)
    visit(key, obj, parent, idx)
    return tree_mod.LEAF


def _walk_mapping(
    manifest: Mapping[Any, Any],
    key: str,
    visit: Callable[[str, Any, Any, Any], None],
    depth: int = 0,
) -> Any:
    pairs = [
        (k, _walk(v, join_key(key, k), visit, manifest, k, depth + 1)) for k, v in manifest.items()
    ]
    return {"o" if isinstance(manifest, OrderedDict) else "d": pairs}


def check_root(state: object) -> None:
    if not (isinstance(state, Mapping) or is_stateful(state)):
        raise InvalidArgumentError(
            f"state must be a mapping (a dict of tensors, values and stateful objects) or an "
            f"object with state_dict()/load_state_dict(), got {type(state).__name__}"
        )


def capture(state: Any) -> Captured:
    """The entries of ``state`` for saving."""
    check_root(state)
    out = Captured()
    seen: set[str] = set()
    boxes = DTensorBoxes()

    def visit(key: str, leaf: Any, _parent: Any, _idx: Any) -> None:
        if key in seen:
            raise InvalidArgumentError(
                f"two entries of the state flatten to the key {key!r} (a dotted key and a nested "
                "one collide); rename one of them",
                key=key,
            )
        seen.add(key)
        if isinstance(leaf, Sharded):
            out.tensors.append(
                TensorItem(key, leaf.local, leaf.global_shape, leaf.region, declared=True)
            )
        elif isinstance(leaf, torch.Tensor):
            out.tensors.append(_leaf_tensor(key, leaf, boxes))
            if not out.mesh and _is_dtensor(leaf):
                out.mesh = mesh_of(leaf)
        else:
            out.values.append(ValueItem(key, leaf))

    out.tree = _walk(state, "", visit, None, None)
    return out


def iter_keys(state: Any) -> Iterator[str]:
    cap = capture(state)
    yield from (t.key for t in cap.tensors)
    yield from (v.key for v in cap.values)
