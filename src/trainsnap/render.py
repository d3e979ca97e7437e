"""How the command line presents things: sizes, times, shapes, and a snapshot's manifest
summarised as tables for people and as JSON for programs.

Nothing here prints or reads storage: :mod:`trainsnap.cli` does both and hands what it found to
these functions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
from rich import box
from rich.table import Table
from rich.text import Text

from .diff import ADDED, CHANGED, REMOVED, RESHAPED, RETYPED, UNCHANGED, TensorDiff
from .manifest import Manifest
from .snapshot import SnapshotInfo
from .spec import Flat, Region

MAX_SHARDS_SHOWN = 3
"""Shards whose geometry ``show`` spells out per tensor; the rest are counted."""


def new_table(title: str | None = None) -> Table:
    """Borderless tables: they fit 80 columns where boxed ones would cut ids short."""
    return Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1, 0, 0),
    )


def human_size(n: int) -> str:
    """Binary units, one decimal: enough to compare snapshot sizes at a glance."""
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        size /= 1024
        if size < 1024 or unit == "PiB":
            break
    return f"{size:.1f} {unit}"


def utc_text(t: datetime) -> str:
    """UTC to the second; a manifest without a zone wrote UTC (trainsnap always does)."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def scope_text(rank: int) -> str:
    return "global" if rank < 0 else f"rank:{rank}"


def shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def flat_items(d: dict[str, Any], prefix: str = "") -> list[str]:
    """``k=v`` pairs, nested mappings as dotted keys, so versions and topology fit on a line."""
    out: list[str] = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out += flat_items(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={json.dumps(v) if not isinstance(v, str) else v}")
    return out


def snapshot_table(
    infos: Sequence[SnapshotInfo],
    verdicts: dict[str, str],
    tiers: dict[str, list[str]] | None = None,
) -> Table:
    table = new_table()
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("id", no_wrap=True)
    table.add_column("created (UTC)", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("level", no_wrap=True)
    table.add_column("verified", no_wrap=True)
    if tiers is not None:
        table.add_column("tiers", no_wrap=True)
    for i in infos:
        verdict = verdicts.get(i.id, "-")
        style = "red bold" if verdict == "CORRUPT" else ""
        created = utc_text(i.created).removesuffix(" UTC")
        row: list[str | Text] = [str(i.step), Text(i.id), created, human_size(i.nbytes)]
        row += [Text(i.level), Text(verdict, style)]
        if tiers is not None:
            row.append(Text("+".join(tiers.get(i.id, []))))
        table.add_row(*row)
    return table


def owner_nbytes(m: Manifest) -> np.ndarray:
    """Stored bytes of each shard, then of each value: the lengths of its chunks, summed."""
    clen = np.zeros(len(m.chunk_length) + 1, np.int64)
    np.cumsum(m.chunk_length, out=clen[1:])
    cs = m.chunk_start()
    out: np.ndarray = clen[cs[1:]] - clen[cs[:-1]]
    return out


def tensor_nbytes(m: Manifest, owner_bytes: np.ndarray) -> list[int]:
    pre = np.zeros(len(m.shard_kind) + 1, np.int64)
    np.cumsum(owner_bytes[: len(m.shard_kind)], out=pre[1:])
    ss = m.shard_start()
    out: list[int] = (pre[ss[1:]] - pre[ss[:-1]]).tolist()
    return out


def geometry_text(region: Region) -> str:
    if isinstance(region, Flat):
        return f"flat start {region.start} len {region.length}"
    return f"box at {shape_text(region.offsets)} size {shape_text(region.sizes)}"


def region_json(region: Region, nbytes: int) -> dict[str, Any]:
    if isinstance(region, Flat):
        return {"kind": "flat", "start": region.start, "length": region.length, "nbytes": nbytes}
    return {
        "kind": "box",
        "offsets": list(region.offsets),
        "sizes": list(region.sizes),
        "nbytes": nbytes,
    }


def largest_object(m: Manifest) -> dict[str, Any] | None:
    if not m.object_names:
        return None
    o = int(np.argmax(m.object_sizes))
    return {"name": m.object_names[o], "nbytes": int(m.object_sizes[o])}


def manifest_json(m: Manifest) -> dict[str, Any]:
    """Everything ``show`` knows, as plain JSON (``rank`` is null for a global tensor)."""
    ob = owner_nbytes(m)
    tb = tensor_nbytes(m, ob)
    base = m.value_chunk_base()
    tensors = [
        {
            "key": key,
            "rank": None if int(m.tensor_ranks[t]) < 0 else int(m.tensor_ranks[t]),
            "dtype": m.tensor_dtypes[t],
            "shape": list(m.tensor_shapes[t]),
            "nbytes": tb[t],
            "shards": [region_json(r, int(ob[s])) for s, r in m.tensor_shards(t)],
        }
        for t, key in enumerate(m.tensor_keys)
    ]
    values = [
        {
            "key": key,
            "rank": None if int(m.value_ranks[v]) < 0 else int(m.value_ranks[v]),
            "codec": m.value_codecs[v],
            "nbytes": int(ob[base + v]),
        }
        for v, key in enumerate(m.value_keys)
    ]
    return {
        "id": m.snapshot_id,
        "step": m.step,
        "created": m.created,
        "level": m.level,
        "nbytes": m.nbytes,
        "tokens_seen": m.tokens_seen,
        "samples_seen": m.samples_seen,
        "data_cursor": m.data_cursor,
        "parent": m.parent,
        "versions": m.versions,
        "topology": m.topology,
        "state_kinds": m.state_kinds,
        "meta": m.meta,
        "checksum": {"algorithm": m.algorithm, "block_size": m.block_size},
        "format_version": m.format_version,
        "tensors": tensors,
        "values": values,
        "objects": {
            "count": len(m.object_names),
            "nbytes": m.nbytes,
            "largest": largest_object(m),
        },
    }


def header_grid(m: Manifest) -> Table:
    kinds = [k for k, present in m.state_kinds.items() if present]
    rows = [
        ("id", m.snapshot_id),
        ("step", str(m.step)),
        ("created", utc_text(SnapshotInfo.from_manifest(m, "").created)),
        ("level", m.level),
        ("size", f"{human_size(m.nbytes)} ({m.nbytes} bytes)"),
        ("tokens seen", "-" if m.tokens_seen is None else str(m.tokens_seen)),
        ("samples seen", "-" if m.samples_seen is None else str(m.samples_seen)),
        ("versions", ", ".join(flat_items(m.versions)) or "-"),
        ("topology", ", ".join(flat_items(m.topology)) or "-"),
        ("state kinds", ", ".join(kinds) or "none recorded"),
        ("checksum", f"{m.algorithm}, blocks of {human_size(m.block_size)}"),
        ("format", f"version {m.format_version}"),
    ]
    if m.parent:
        rows.append(("parent", m.parent))
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for name, value in rows:
        grid.add_row(name, Text(value))
    return grid


def tensor_table(m: Manifest, ob: np.ndarray) -> Table:
    tb = tensor_nbytes(m, ob)
    table = new_table(f"tensors ({len(m.tensor_keys)})")
    for name in ("key", "scope", "dtype", "shape", "shards", "bytes", "shard geometry"):
        right = name in ("shards", "bytes")
        table.add_column(name, justify="right" if right else "left", overflow="fold")
    for t, key in enumerate(m.tensor_keys):
        shards = m.tensor_shards(t)
        geo = [geometry_text(r) for _, r in shards[:MAX_SHARDS_SHOWN]]
        if len(shards) > MAX_SHARDS_SHOWN:
            geo.append(f"+{len(shards) - MAX_SHARDS_SHOWN} more")
        table.add_row(
            Text(key),
            scope_text(int(m.tensor_ranks[t])),
            m.tensor_dtypes[t],
            shape_text(m.tensor_shapes[t]),
            str(len(shards)),
            str(tb[t]),
            Text("\n".join(geo)),
        )
    return table


def value_table(m: Manifest, ob: np.ndarray) -> Table:
    base = m.value_chunk_base()
    table = new_table(f"values ({len(m.value_keys)})")
    for name in ("key", "scope", "codec", "bytes"):
        table.add_column(name, justify="right" if name == "bytes" else "left", overflow="fold")
    for v, key in enumerate(m.value_keys):
        scope = scope_text(int(m.value_ranks[v]))
        table.add_row(Text(key), scope, m.value_codecs[v], str(int(ob[base + v])))
    return table


def objects_line(m: Manifest) -> str:
    largest = largest_object(m)
    line = f"objects: {len(m.object_names)}, {human_size(m.nbytes)} in all"
    if largest:
        line += f", largest {largest['name']} ({human_size(largest['nbytes'])})"
    return line


def number_text(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


_DIFF_GROUP = {CHANGED: 0, RETYPED: 0, RESHAPED: 1, ADDED: 2, REMOVED: 3, UNCHANGED: 4}


def diff_order(d: TensorDiff) -> tuple[int, float, str, int]:
    """Largest relative change first (NaN and inf on top: they are what one looks for), then
    reshaped, added, removed, unchanged."""
    rel = d.rel_norm
    weight = math.inf if rel is None or math.isnan(rel) else rel
    return (_DIFF_GROUP[d.status], -weight, d.key, d.rank)


def diff_table(title: str, diffs: Sequence[TensorDiff]) -> Table:
    table = new_table(title)
    for name in ("key", "status", "dtype", "shape", "max |a-b|", "|a-b|/|a|"):
        right = name.startswith(("max", "|"))
        table.add_column(name, justify="right" if right else "left", overflow="fold")
    for d in diffs:
        da, db = d.dtype_a or d.dtype_b or "-", d.dtype_b or d.dtype_a or "-"
        sa, sb = d.shape_a or d.shape_b or (), d.shape_b or d.shape_a or ()
        table.add_row(
            Text(d.label),
            d.status,
            da if da == db else f"{da} -> {db}",
            shape_text(sa) if sa == sb else f"{shape_text(sa)} -> {shape_text(sb)}",
            number_text(d.max_abs),
            number_text(d.rel_norm),
        )
    return table
