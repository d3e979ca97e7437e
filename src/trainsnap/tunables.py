"""Internal tunables, in one place, each overridable by an environment variable.

These are not user options (those are keyword arguments of the public API); they are the knobs a
performance investigation turns. ``TRAINSNAP_<NAME>`` overrides ``<name>``, read when first used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from trainsnap.errors import InvalidArgumentError

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Tunables:
    block_size: int = 1 * MiB
    """Bytes covered by one checksum. A read verifies whole blocks, so this is also the most a
    ranged read fetches beyond what it needs at each end."""

    chunk_size: int = 32 * MiB
    """Largest object written for one shard chunk; bigger shards are cut into chunks this size.
    Also the unit of reuse for incremental snapshots."""

    pack_threshold: int = 1 * MiB
    """Shards and values smaller than this are packed together into shared objects."""

    io_threads: int = 8
    """Threads of the I/O pool (reads, writes, hashing; hashing and syscalls release the GIL)."""

    read_budget: int = 256 * MiB
    """Most host memory a load holds in bounce buffers at once (strided pieces, devices)."""

    block_cache: int = 64 * MiB
    """Most bytes of verified blocks a load keeps to serve later reads of the same block (the
    block several packed values and small tensors share is then read and verified once). Past
    it, a block needed again is read again."""

    direct_reads: int = 1
    """1: a load reads the windows it copies through a bounce buffer straight from the device
    (``O_DIRECT``) when none of their bytes is in the page cache and the root's file system
    allows it; 0: always through the page cache."""

    min_row: int = 16 << 10
    """Bytes: a piece whose destination rows are at least this long is read straight into its
    rows (a scatter list of rows per block); shorter rows are read a window at a time and
    copied (the read path of docs/ARCHITECTURE.md says why)."""

    read_window: int = 2 * MiB
    """Bytes of a short-row piece read, verified and copied at a time (at least a block)."""

    coalesce_max: int = 8 * MiB
    """Most bytes one gathered read covers: reads smaller than a block in one object are
    gathered into runs of at most this span, each run's blocks read and verified once."""

    copy_max: int = 64 * MiB
    """Most source bytes one bounce-buffer task of a piece covers (and at most a quarter of
    ``read_budget``): larger pieces are cut into tasks of this size."""

    replica_reads: int = 1
    """Ranks that need the same bytes (data-parallel replicas) split the reads and send each
    other what they read (:mod:`trainsnap.protocol.replica_reads`): 1 where it helps (an object
    store, or replicas on different hosts), 2 always, 0 never (every rank reads all it needs)."""

    replica_group_max: int = 32
    """Most ranks that share the reads of one top-level key: more replicas are cut into groups of
    consecutive ranks this size, so that no rank's exchange (and its metadata) grows with the
    world; each group reads its bytes once."""

    report_inline_max: int = 512
    """A rank's encoded write report larger than this many bytes is written to storage
    (``snapshots/<id>/reports/<rank>``) and only its size and digest go through the control
    plane (:mod:`trainsnap.protocol.write_reports`); a smaller one is sent as it is."""

    heartbeat_seconds: int = 60
    """A rank whose heartbeat stops for this long during a save or load is taken as dead."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 64:
            raise InvalidArgumentError(
                f"block_size must be a positive multiple of 64 bytes, got {self.block_size}"
            )
        if self.chunk_size < self.block_size or self.chunk_size % self.block_size:
            raise InvalidArgumentError(
                f"chunk_size ({self.chunk_size}) must be a multiple of block_size "
                f"({self.block_size})"
            )
        if self.pack_threshold > self.chunk_size:
            # A packed payload must fit in one object: the threshold is capped at the chunk.
            object.__setattr__(self, "pack_threshold", self.chunk_size)
        if self.io_threads < 1:
            raise InvalidArgumentError(f"io_threads must be >= 1, got {self.io_threads}")
        if self.report_inline_max < 0:
            raise InvalidArgumentError(
                f"report_inline_max must be >= 0, got {self.report_inline_max}"
            )
        for name in ("min_row", "read_window", "coalesce_max", "copy_max"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.read_budget < 2 * self.block_size:
            raise InvalidArgumentError(
                f"read_budget ({self.read_budget}) must hold at least two blocks "
                f"({2 * self.block_size} bytes)"
            )


def from_env(environ: dict[str, str] | None = None) -> Tunables:
    """The defaults with any ``TRAINSNAP_<NAME>`` environment overrides applied."""
    env = os.environ if environ is None else environ
    overrides: dict[str, int] = {}
    for f in fields(Tunables):
        raw = env.get(f"TRAINSNAP_{f.name.upper()}")
        if raw is None:
            continue
        try:
            overrides[f.name] = int(raw)
        except ValueError as e:
            raise InvalidArgumentError(
                f"environment variable TRAINSNAP_{f.name.upper()}={raw!r} is not an integer"
            ) from e
    return Tunables(**overrides)


_current: Tunables | None = None


def get() -> Tunables:
    """The tunables of this process (environment read once)."""
    global _current
    if _current is None:
        _current = from_env()
    return _current


def set_for_testing(values: Tunables | None) -> None:
    """Replace the process tunables (``None`` re-reads the environment on next use)."""
    global _current
    _current = values
