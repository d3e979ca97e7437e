"""What a save records and how it stores it: :class:`SaveOptions`."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainsnap.errors import InvalidArgumentError
from trainsnap.format.manifest import LEVELS
from trainsnap.format.values import PickleKeys
from trainsnap.protocol.rank_save import SaveRequest
from trainsnap.state.train_state import TrainState


@dataclass(kw_only=True, slots=True)
class SaveOptions:
    """Options of :func:`trainsnap.save`, :func:`trainsnap.async_save` and the manager's saves.

    A :class:`~trainsnap.TrainState` supplies the level, versions and counters itself; the
    fields here add to or override them.
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
    top-level key to either (``{"optim": "bytegroup+zstd"}``)."""
    chunk_size: int | None = None
    """Object size of large tensors (default: the ``chunk_size`` tunable); smaller chunks make
    incremental snapshots finer-grained at the cost of more objects."""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise InvalidArgumentError(f"level must be one of {LEVELS}, got {self.level!r}")

    def request(
        self, state: Any, step: int, parts: Collection[str] | None = None
    ) -> tuple[Any, SaveRequest]:
        """The tree to save and what the save records; a :class:`TrainState` gives its tree,
        kinds, level, versions and counters (only ``parts`` of it, when given)."""
        tree, kinds, level = state, {}, self.level
        versions = dict(self.versions)
        tokens_seen, samples_seen, cursor = self.tokens_seen, self.samples_seen, self.data_cursor
        if isinstance(state, TrainState):
            tree = state.save_tree(parts)
            kinds, level = state.kinds(parts), state.offered_level(parts)
            versions = {**state.versions, **versions}
            tokens, samples = state.counters()
            tokens_seen = tokens if tokens_seen is None else tokens_seen
            samples_seen = samples if samples_seen is None else samples_seen
            cursor = state.data_cursor() if cursor is None else cursor
        request = SaveRequest(
            step=step,
            level=level,
            tokens_seen=tokens_seen,
            samples_seen=samples_seen,
            data_cursor=cursor,
            state_kinds=kinds,
            user_versions=versions,
            meta=dict(self.meta),
            allow_pickle=self.allow_pickle,
            checksum=self.checksum,
            compression=self.compression,
            chunk_size=self.chunk_size,
        )
        return tree, request
