"""The save plan's records: what a rank holds (:class:`RankMeta`: entries and values), what it
writes (:class:`Assignment`) and the plan of every rank (:class:`SavePlan`). Pure: no I/O.

Records cross the control plane as plain tuples (a NamedTuple pickles several times slower) and
become records again on arrival (:func:`flat_entries`).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from trainsnap.format.regions import Region, Shape

GLOBAL = -1


class Entry(NamedTuple):
    """One tensor entry of a rank: a region of a logical tensor it holds.

    ``digest`` is given for undeclared replicas (a plain tensor that several ranks may hold):
    the plan stores it once only if every holder's bytes are identical. Declared layouts
    (``DTensor``, ``ts.Sharded``) carry ``None`` and are deduplicated by region alone.
    """

    key: str
    dtype: str
    """The dtype's name (:func:`trainsnap.format.values.dtype_name`)."""
    shape: Shape
    """The logical tensor's global shape."""
    region: Region
    nbytes: int
    digest: bytes | None


class Value(NamedTuple):
    """One plain value of a rank, encoded."""

    key: str
    codec: str
    digest: bytes
    """Digest of the encoded bytes."""
    nbytes: int


class Assigned(NamedTuple):
    """One payload a rank writes, and its scope."""

    item: int
    """Its index in the rank's flattened entries (or in its values)."""
    scope: int
    """``GLOBAL``, or the rank whose own copy it is."""


# Records travel between ranks as plain tuples: a named tuple pickles several times slower,
# and a large job's plan moves millions. These make them records again on arrival without
# the per-field Python constructor.
_as_entry = partial(tuple.__new__, Entry)
_as_value = partial(tuple.__new__, Value)
_as_assigned = partial(tuple.__new__, Assigned)


def _decode(blob: bytes) -> list[Entry]:
    """The entries of a blob :meth:`RankMeta.pack` made. O(entries)."""
    return list(map(_as_entry, pickle.loads(blob)))


@dataclass(slots=True)
class RankMeta:
    rank: int
    step: int
    groups: list[tuple[str, bytes]] = field(default_factory=list)
    """(top-level key, pickled list of :class:`Entry`, as plain tuples) -- identical blobs are
    processed once."""
    values: list[Value] = field(default_factory=list)
    error: str | None = None
    """Set when this rank could not even describe its state; the save is refused everywhere."""
    tree: Any = None
    """The structure of this rank's state (:mod:`trainsnap.format.tree`)."""
    layout: bytes = b""
    """Digest of this rank's layout: entries (keys, dtypes, shapes, regions, sizes, replica
    digests), value keys and codecs, and the tree."""
    cached: bool = False
    """True when ``groups`` and ``tree`` were left out: the layout is the one this rank sent
    last, which the coordinator's :class:`PlanCache` holds."""

    def __getstate__(self) -> tuple[Any, ...]:
        """Pickled with plain tuples for records (see ``_as_entry``)."""
        values = list(map(tuple, self.values))
        return (
            self.rank,
            self.step,
            self.groups,
            values,
            self.error,
            self.tree,
            self.layout,
            self.cached,
        )

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.rank, self.step, self.groups, values, self.error, self.tree = state[:6]
        self.layout, self.cached = state[6:]
        self.values = list(map(_as_value, values))

    @staticmethod
    def pack(
        rank: int, step: int, entries: Sequence[Entry], values: list[Value], tree: Any = None
    ) -> RankMeta:
        # A group is a run of consecutive entries under one top-level key, in the rank's own
        # order: assignment indices count through the groups (:func:`flat_entries`) and the
        # rank's writer looks them up in ``entries``, so grouping must never reorder (a state
        # built parameter by parameter interleaves ``model.*`` and ``optim.*``).
        runs: list[tuple[str, list[tuple[Any, ...]]]] = []
        # Equal shapes and regions made one object each: pickle then writes each once per blob,
        # and the coordinator decodes a rank's thousand shards into a few dozen boxes, not a
        # thousand (a quarter less to send; a third fewer objects for its garbage collector).
        shapes: dict[Shape, Shape] = {}
        regions: dict[Region, Region] = {}
        for key, dtype, shape, region, nbytes, digest in entries:
            shared = (shapes.setdefault(shape, shape), regions.setdefault(region, region))
            # Plain tuples on the wire: a named tuple pickles to more bytes and loads slower.
            group = key.split(".", 1)[0]
            if not runs or runs[-1][0] != group:
                runs.append((group, []))
            runs[-1][1].append((key, dtype, *shared, nbytes, digest))
        groups = [(g, pickle.dumps(es, protocol=5)) for g, es in runs]
        return RankMeta(rank, step, groups, list(map(_as_value, values)), tree=tree)


@dataclass(slots=True)
class Assignment:
    snapshot_id: str = ""
    entries: list[Assigned] = field(default_factory=list)
    """The entries it writes (indices in this rank's flattened entries)."""
    values: list[Assigned] = field(default_factory=list)
    """The values it writes (indices in this rank's values)."""
    problems: list[str] = field(default_factory=list)
    """Why the save is refused (identical on every rank); empty when it goes ahead."""

    def __getstate__(self) -> tuple[Any, ...]:
        """Pickled with plain tuples for records (see ``_as_entry``)."""
        entries, values = list(map(tuple, self.entries)), list(map(tuple, self.values))
        return (self.snapshot_id, entries, values, self.problems)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.snapshot_id, entries, values, self.problems = state
        self.entries = list(map(_as_assigned, entries))
        self.values = list(map(_as_assigned, values))


@dataclass(slots=True)
class SavePlan:
    assignments: list[Assignment]
    bytes_per_rank: list[int]
    tensors: dict[tuple[str, int], tuple[str, Shape]]
    """(key, scope) -> (dtype, global shape) of every tensor the snapshot will hold."""
    decoded: dict[bytes, list[Entry]] = field(default_factory=dict)
    """The entry blobs as decoded by the plan (the coordinator's manifest reuses them)."""
    metas: list[RankMeta] = field(default_factory=list)
    """The rank descriptions the plan was made from (one process: made by the plan)."""
    tree: Any = None
    """The structure of the whole state: every rank's, merged."""

    @property
    def problems(self) -> list[str]:
        return self.assignments[0].problems if self.assignments else []


def flat_entries(meta: RankMeta, decoded: dict[bytes, list[Entry]]) -> list[Entry]:
    """A rank's entries in group order (the order :class:`Assignment` indices refer to)."""
    out: list[Entry] = []
    for _g, blob in meta.groups:
        es = decoded.get(blob)
        if es is None:
            es = decoded[blob] = _decode(blob)
        out.extend(es)
    return out
