"""How the command line presents things: sizes, times, shapes, and a snapshot's manifest
summarised as tables for people and as JSON for programs.

Nothing here prints or reads storage: :mod:`trainsnap.tools.cli` does both and hands what it
found to
these functions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich import box
from rich.table import Table
from rich.text import Text

from trainsnap.format.manifest import Manifest
from trainsnap.format.regions import Flat, Region
from trainsnap.manager.restarts import History, Run
from trainsnap.protocol.snapshot_info import SnapshotInfo
from trainsnap.tools import plot as plot_module

if TYPE_CHECKING:  # diff needs torch; the commands that only list or show start without it
    from trainsnap.tools.diff import TensorDiff

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


def human_size(nbytes: int) -> str:
    """Binary units, one decimal: enough to compare snapshot sizes at a glance."""
    if nbytes < 1024:
        return f"{nbytes} B"
    size = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        size /= 1024
        if size < 1024 or unit == "PiB":
            break
    return f"{size:.1f} {unit}"


def utc_text(moment: datetime) -> str:
    """UTC to the second; a manifest without a zone wrote UTC (trainsnap always does)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def scope_text(rank: int) -> str:
    return "global" if rank < 0 else f"rank:{rank}"


def shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def flat_items(mapping: dict[str, Any], prefix: str = "") -> list[str]:
    """``k=v`` pairs, nested mappings as dotted keys, so versions and topology fit on a line."""
    out: list[str] = []
    for k, v in mapping.items():
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


def owner_nbytes(manifest: Manifest) -> np.ndarray:
    """Stored bytes of each shard, then of each value: the lengths of its chunks, summed."""
    clen = np.zeros(len(manifest.chunk_length) + 1, np.int64)
    np.cumsum(manifest.chunk_length, out=clen[1:])
    cs = manifest.chunk_start()
    out: np.ndarray = clen[cs[1:]] - clen[cs[:-1]]
    return out


def tensor_nbytes(manifest: Manifest, owner_bytes: np.ndarray) -> list[int]:
    pre = np.zeros(len(manifest.shard_kind) + 1, np.int64)
    np.cumsum(owner_bytes[: len(manifest.shard_kind)], out=pre[1:])
    ss = manifest.shard_start()
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


def largest_object(manifest: Manifest) -> dict[str, Any] | None:
    if not manifest.object_names:
        return None
    o = int(np.argmax(manifest.object_sizes))
    return {"name": manifest.object_names[o], "nbytes": int(manifest.object_sizes[o])}


def manifest_json(manifest: Manifest) -> dict[str, Any]:
    """Everything ``show`` knows, as plain JSON (``rank`` is null for a global tensor)."""
    ob = owner_nbytes(manifest)
    tb = tensor_nbytes(manifest, ob)
    base = manifest.value_chunk_base()
    tensors = [
        {
            "key": key,
            "rank": None if int(manifest.tensor_ranks[t]) < 0 else int(manifest.tensor_ranks[t]),
            "dtype": manifest.tensor_dtypes[t],
            "shape": list(manifest.tensor_shapes[t]),
            "nbytes": tb[t],
            "shards": [region_json(r, int(ob[s])) for s, r in manifest.tensor_shards(t)],
        }
        for t, key in enumerate(manifest.tensor_keys)
    ]
    values = [
        {
            "key": key,
            "rank": None if int(manifest.value_ranks[v]) < 0 else int(manifest.value_ranks[v]),
            "codec": manifest.value_codecs[v],
            "nbytes": int(ob[base + v]),
        }
        for v, key in enumerate(manifest.value_keys)
    ]
    return {
        "id": manifest.snapshot_id,
        "step": manifest.step,
        "created": manifest.created,
        "level": manifest.level,
        "nbytes": manifest.nbytes,
        "tokens_seen": manifest.tokens_seen,
        "samples_seen": manifest.samples_seen,
        "data_cursor": manifest.data_cursor,
        "parent": manifest.parent,
        "versions": manifest.versions,
        "topology": manifest.topology,
        "state_kinds": manifest.state_kinds,
        "meta": manifest.meta,
        "checksum": {"algorithm": manifest.algorithm, "block_size": manifest.block_size},
        "format_version": manifest.format_version,
        "tensors": tensors,
        "values": values,
        "objects": {
            "count": len(manifest.object_names),
            "nbytes": manifest.nbytes,
            "largest": largest_object(manifest),
        },
    }


def header_grid(manifest: Manifest) -> Table:
    kinds = [k for k, present in manifest.state_kinds.items() if present]
    rows = [
        ("id", manifest.snapshot_id),
        ("step", str(manifest.step)),
        ("created", utc_text(SnapshotInfo.from_manifest(manifest, "").created)),
        ("level", manifest.level),
        ("size", f"{human_size(manifest.nbytes)} ({manifest.nbytes} bytes)"),
        ("tokens seen", "-" if manifest.tokens_seen is None else str(manifest.tokens_seen)),
        ("samples seen", "-" if manifest.samples_seen is None else str(manifest.samples_seen)),
        ("versions", ", ".join(flat_items(manifest.versions)) or "-"),
        ("topology", ", ".join(flat_items(manifest.topology)) or "-"),
        ("state kinds", ", ".join(kinds) or "none recorded"),
        ("checksum", f"{manifest.algorithm}, blocks of {human_size(manifest.block_size)}"),
        ("format", f"version {manifest.format_version}"),
    ]
    if manifest.parent:
        rows.append(("parent", manifest.parent))
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for name, value in rows:
        grid.add_row(name, Text(value))
    return grid


def tensor_table(manifest: Manifest, owner_base: np.ndarray) -> Table:
    tb = tensor_nbytes(manifest, owner_base)
    table = new_table(f"tensors ({len(manifest.tensor_keys)})")
    for name in ("key", "scope", "dtype", "shape", "shards", "bytes", "shard geometry"):
        right = name in ("shards", "bytes")
        table.add_column(name, justify="right" if right else "left", overflow="fold")
    for t, key in enumerate(manifest.tensor_keys):
        shards = manifest.tensor_shards(t)
        geo = [geometry_text(r) for _, r in shards[:MAX_SHARDS_SHOWN]]
        if len(shards) > MAX_SHARDS_SHOWN:
            geo.append(f"+{len(shards) - MAX_SHARDS_SHOWN} more")
        table.add_row(
            Text(key),
            scope_text(int(manifest.tensor_ranks[t])),
            manifest.tensor_dtypes[t],
            shape_text(manifest.tensor_shapes[t]),
            str(len(shards)),
            str(tb[t]),
            Text("\n".join(geo)),
        )
    return table


def value_table(manifest: Manifest, owner_base: np.ndarray) -> Table:
    base = manifest.value_chunk_base()
    table = new_table(f"values ({len(manifest.value_keys)})")
    for name in ("key", "scope", "codec", "bytes"):
        table.add_column(name, justify="right" if name == "bytes" else "left", overflow="fold")
    for v, key in enumerate(manifest.value_keys):
        scope = scope_text(int(manifest.value_ranks[v]))
        table.add_row(Text(key), scope, manifest.value_codecs[v], str(int(owner_base[base + v])))
    return table


def objects_line(manifest: Manifest) -> str:
    largest = largest_object(manifest)
    line = f"objects: {len(manifest.object_names)}, {human_size(manifest.nbytes)} in all"
    if largest:
        line += f", largest {largest['name']} ({human_size(largest['nbytes'])})"
    return line


def number_text(number: float | None) -> str:
    return "-" if number is None else f"{number:.3g}"


_DIFF_GROUP = {"changed": 0, "retyped": 0, "reshaped": 1, "added": 2, "removed": 3, "unchanged": 4}
"""Order of :mod:`trainsnap.tools.diff`'s statuses in a table (its names, spelled here so that
this module does not import torch)."""


def diff_order(diff: TensorDiff) -> tuple[int, float, str, int]:
    """Largest relative change first (NaN and inf on top: they are what one looks for), then
    reshaped, added, removed, unchanged."""
    rel = diff.rel_norm
    weight = math.inf if rel is None or math.isnan(rel) else rel
    return (_DIFF_GROUP[diff.status], -weight, diff.key, diff.rank)


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


# -- the restart history ---------------------------------------------------------------------------


def seconds_text(seconds: float | None) -> str:
    """Seconds with the precision that matters at their size: 3 significant digits below 100
    (0.0123, 4.56, 45.6), whole seconds above; "-" when unknown."""
    if seconds is None:
        return "-"
    if abs(seconds) >= 100:
        return f"{seconds:.0f}"
    if seconds == 0:
        return "0"
    return f"{seconds:.3g}"


def _lost_steps_text(run: Run) -> str:
    if run.lost_steps is None:
        return "-"
    return f">={run.lost_steps}" if run.lost_is_lower_bound else str(run.lost_steps)


def _reached_text(run: Run) -> str:
    if run.step_reached is None:
        return "-"
    return f">={run.step_reached}" if run.reach_is_lower_bound else str(run.step_reached)


def _start_text(started: float) -> str:
    """Month, day and time in UTC: a job's runs rarely span years, and the full date with its
    zone would take a quarter of an 80-column line."""
    return datetime.fromtimestamp(started, timezone.utc).strftime("%m-%d %H:%M:%S")


HISTORY_NOTES = (
    "times in seconds, starts in UTC; reached: the last step whose step() returned;",
    "  >=N: at least N (the run may have gone on past its last progress record);",
    "  running: no close() yet (still running, or it exited without close());",
    "  superseded: a newer job took the root over while it still ran",
)
"""The legend under ``history``'s table, each line under 80 columns."""


def history_table(runs: Sequence[Run]) -> Table:
    """One row per run: how it ended, how far it got, and what its restart lost. Fits 80
    columns: the restored snapshot is named by its step (``trainsnap show ROOT STEP``), its id
    is in ``history --json``; the restart's times are in :func:`restarts_table`."""
    table = new_table("runs (one per writer generation)")
    columns = ("gen", "started", "end", "reached", "restored", "level", "lost", "lost s")
    for name in columns:
        table.add_column(name, justify="left" if name in ("started", "end", "level") else "right")
    for run in runs:
        table.add_row(
            str(run.generation),
            _start_text(run.started),
            Text(run.end),
            _reached_text(run),
            "-" if run.restored_step is None else str(run.restored_step),
            Text(run.level or "-"),
            _lost_steps_text(run),
            seconds_text(run.lost_seconds),
        )
    return table


RESTART_NOTES = (
    "from: memory (this node), memory (partner node): some node took shards from",
    "  another node's memory, local disk, durable; partner: bytes from partners;",
    "  seconds: restore, from the restore's start to its end; to step, from then to",
    "  the first step; RTO, from the previous run's last record (progress or event)",
    "  to the restore's end",
)
"""The legend under ``history``'s restarts table, each line under 80 columns."""


def restarts_table(runs: Sequence[Run]) -> Table | None:
    """One row per restart (a run that restored a snapshot): where it restored from, the
    steps it lost and how long it took to be back (its RTO); None when no run restored.
    Fits 80 columns."""
    restored = [run for run in runs if run.restored_step is not None]
    if not restored:
        return None
    table = new_table("restarts (one per restore)")
    columns = ("gen", "restored", "from", "partner", "lost", "restore", "to step", "RTO")
    for name in columns:
        table.add_column(name, justify="left" if name == "from" else "right", no_wrap=True)
    for run in restored:
        table.add_row(
            str(run.generation),
            str(run.restored_step),
            Text(run.restored_from or "-"),
            "-" if run.partner_bytes is None else human_size(run.partner_bytes),
            _lost_steps_text(run),
            seconds_text(run.restore_seconds),
            seconds_text(run.to_first_step_seconds),
            seconds_text(run.rto_seconds),
        )
    return table


def history_totals(job: History) -> list[str]:
    """The totals under the table, one line each; crashes are the runs the table shows as
    ``crash`` (a ``running`` newest run is not one)."""
    bound = any(r.lost_is_lower_bound for r in job.runs)
    lines = [
        f"wall time {seconds_text(job.wall_seconds)} s; down {seconds_text(job.down_seconds)} s; "
        f"lost work {'at least ' if bound else ''}{seconds_text(job.lost_seconds)} s; goodput "
        + ("-" if job.goodput is None else f"{job.goodput:.1%}"),
        "mean lost work per restart: "
        + (
            "- (no restart)"
            if job.mean_lost_steps is None
            else f"{'at least ' if bound else ''}{job.mean_lost_steps:.3g} steps, "
            f"{seconds_text(job.mean_lost_seconds or 0.0)} s"
        ),
        f"crashes {job.crashes}; observed MTBF "
        + ("- (no crash)" if job.mtbf_seconds is None else f"{seconds_text(job.mtbf_seconds)} s"),
    ]
    if job.young_seconds is not None and job.daly_seconds is not None:
        lines.append(
            f"implied interval (save cost {seconds_text(job.save_cost_seconds)} s): Young "
            f"{seconds_text(job.young_seconds)} s, Daly {seconds_text(job.daly_seconds)} s; "
            f"in use: {job.interval_in_use or '-'}"
        )
    else:
        lines.append(f"interval in use: {job.interval_in_use or '-'}")
    return lines


def history_chart(job: History, path: Path) -> Path:
    """A PNG of steps over wall time, one line per run, crashes marked (``history --plot``)."""
    origin = min(run.started for run in job.runs)
    series, marks = [], []
    palette = ("blue", "orange", "green", "purple", "red", "grey")
    for i, run in enumerate(job.runs):
        points = [(when - origin, float(step)) for when, step in run.saves]
        if run.restored_at is not None and run.restored_step is not None:
            points.insert(0, (run.restored_at - origin, float(run.restored_step)))
        if run.time_reached is not None and run.step_reached is not None:
            points.append((run.time_reached - origin, float(run.step_reached)))
        if points:
            series.append((f"run {run.generation} ({run.end})", sorted(points), palette[i % 6]))
        if run.end == "crash" and run.time_reached is not None:
            marks.append(
                plot_module.Mark(run.time_reached - origin, f"crash {run.generation}", "red")
            )
    return plot_module.png_chart(
        series,
        path,
        title="training progress across restarts",
        x_label="wall time (s)",
        y_label="step",
        marks=marks,
    )
