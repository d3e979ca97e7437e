"""The coordinator's manifest: every rank's write report joined into one index."""

from __future__ import annotations

import platform
from collections import defaultdict
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import torch

from trainsnap._version import __version__
from trainsnap.format.checksums import Hasher
from trainsnap.format.manifest import STATE_KINDS, Manifest, ManifestBuilder
from trainsnap.format.regions import Box, Region
from trainsnap.protocol.planner import GLOBAL, RankMeta, SavePlan, flat_entries
from trainsnap.protocol.rank_save import SaveRequest, WriteReport


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def library_versions(user: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "user": dict(user),
        "trainsnap": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _order(region: Region) -> tuple[int, ...]:
    return region.offsets if isinstance(region, Box) else (region.start,)


def assemble(
    snapshot_id: str,
    opts: SaveRequest,
    hasher: Hasher,
    metas: list[RankMeta],
    plan: SavePlan,
    reports: list[WriteReport],
    topology: Mapping[str, Any],
) -> Manifest:
    """One manifest from the reports: tensors sorted by key, shards by position."""
    options = opts.options
    b = ManifestBuilder(
        snapshot_id=snapshot_id,
        created=now_iso(),
        step=opts.step,
        level=options.level,
        algorithm=hasher.algorithm,
        block_size=hasher.block_size,
        tokens_seen=options.tokens_seen,
        samples_seen=options.samples_seen,
        data_cursor=options.data_cursor,
        state_kinds={k: bool(opts.state_kinds.get(k, False)) for k in STATE_KINDS},
        versions=library_versions(options.versions),
        topology=dict(topology),
        meta=dict(options.meta),
        tree=plan.tree,
    )
    decoded: dict[bytes, Any] = plan.decoded
    shards: dict[tuple[str, int], list[tuple[Region, list[tuple[int, int, int]]]]]
    shards = defaultdict(list)
    values: list[tuple[str, int, str, list[tuple[int, int, int]]]] = []
    for rank, report in enumerate(reports):
        index = [b.add_stored(obj) for obj in report.objects]
        if report.entries:
            entries = flat_entries(metas[rank], decoded)
            for i, scope, chunks in report.entries:
                entry = entries[i]
                placed = [(index[o], off, n) for o, off, n in chunks]
                shards[(entry.key, scope)].append((entry.region, placed))
        for i, scope, chunks in report.values:
            value = metas[rank].values[i]
            placed = [(index[o], off, n) for o, off, n in chunks]
            values.append((value.key, scope, value.codec, placed))
    for (key, scope), (dtype, shape) in sorted(plan.tensors.items()):
        t = b.add_tensor(key, scope, dtype, shape)
        for region, chunks in sorted(shards.get((key, scope), []), key=lambda s: _order(s[0])):
            b.add_shard(t, region, chunks)
    for key, scope, codec, chunks in sorted(values, key=lambda v: (v[0], v[1])):
        b.add_value(key, scope, codec, chunks)
    return b.build()


__all__ = ["GLOBAL", "assemble", "library_versions", "now_iso"]
