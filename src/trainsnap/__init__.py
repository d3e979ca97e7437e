"""trainsnap: crash-consistent, reshardable, verifiable snapshots of PyTorch training state.

The names in ``__all__`` are the stable API, together with :mod:`trainsnap.storage` (the storage
protocol and backends), :mod:`trainsnap.testing` (the multi-rank test harness) and
:mod:`trainsnap.integrations`. The layer packages below them (``format``, ``engine``, ``state``,
``protocol``, ``api``, ``manager``, ``tools``) are the implementation: importable, but with no
promise that their names stay.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainsnap._version import __version__
from trainsnap.errors import (
    CommitFailedError,
    CorruptError,
    IncompatibleError,
    IncompleteError,
    InvalidArgumentError,
    LoadFailedError,
    NotFoundError,
    TrainsnapError,
)

if TYPE_CHECKING:
    from trainsnap import trace
    from trainsnap.api.async_saver import AsyncSaver, SaveHandle
    from trainsnap.api.options import SaveOptions
    from trainsnap.api.snapshots import async_save, delete, list_snapshots, load, read, save
    from trainsnap.api.verification import VerifyReport, verify
    from trainsnap.manager import tiers
    from trainsnap.manager.checkpoint_manager import CheckpointManager
    from trainsnap.manager.options import LocalTier, ManagerOptions, MemoryTier
    from trainsnap.manager.policies import (
        Every,
        KeepBest,
        KeepEvery,
        KeepLast,
        KeepTagged,
        StepInfo,
        YoungDaly,
        daly_interval,
        young_interval,
    )
    from trainsnap.protocol.snapshot_info import SnapshotInfo
    from trainsnap.state import rng, sampler
    from trainsnap.state.capture import Sharded
    from trainsnap.state.sampler import ElasticSampler
    from trainsnap.state.train_state import TrainState
    from trainsnap.storage import open_storage

_LAZY: dict[str, str] = {
    "AsyncSaver": "trainsnap.api.async_saver",
    "SaveHandle": "trainsnap.api.async_saver",
    "SaveOptions": "trainsnap.api.options",
    "async_save": "trainsnap.api.snapshots",
    "delete": "trainsnap.api.snapshots",
    "list_snapshots": "trainsnap.api.snapshots",
    "load": "trainsnap.api.snapshots",
    "read": "trainsnap.api.snapshots",
    "save": "trainsnap.api.snapshots",
    "VerifyReport": "trainsnap.api.verification",
    "verify": "trainsnap.api.verification",
    "CheckpointManager": "trainsnap.manager.checkpoint_manager",
    "LocalTier": "trainsnap.manager.options",
    "ManagerOptions": "trainsnap.manager.options",
    "MemoryTier": "trainsnap.manager.options",
    "Every": "trainsnap.manager.policies",
    "KeepBest": "trainsnap.manager.policies",
    "KeepEvery": "trainsnap.manager.policies",
    "KeepLast": "trainsnap.manager.policies",
    "KeepTagged": "trainsnap.manager.policies",
    "StepInfo": "trainsnap.manager.policies",
    "YoungDaly": "trainsnap.manager.policies",
    "daly_interval": "trainsnap.manager.policies",
    "young_interval": "trainsnap.manager.policies",
    "SnapshotInfo": "trainsnap.protocol.snapshot_info",
    "Sharded": "trainsnap.state.capture",
    "ElasticSampler": "trainsnap.state.sampler",
    "TrainState": "trainsnap.state.train_state",
    "open_storage": "trainsnap.storage",
}
"""Public names and the module each comes from, imported on first use: the command line (which
imports this package first) starts without loading torch for the commands that do not need it."""

_SUBMODULES = {
    "rng": "trainsnap.state.rng",
    "sampler": "trainsnap.state.sampler",
    "tiers": "trainsnap.manager.tiers",
    "trace": "trainsnap.trace",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
    else:
        raise AttributeError(f"module 'trainsnap' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AsyncSaver",
    "CheckpointManager",
    "CommitFailedError",
    "CorruptError",
    "ElasticSampler",
    "Every",
    "IncompatibleError",
    "IncompleteError",
    "InvalidArgumentError",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepTagged",
    "LoadFailedError",
    "LocalTier",
    "ManagerOptions",
    "MemoryTier",
    "NotFoundError",
    "SaveHandle",
    "SaveOptions",
    "Sharded",
    "SnapshotInfo",
    "StepInfo",
    "TrainState",
    "TrainsnapError",
    "VerifyReport",
    "YoungDaly",
    "__version__",
    "async_save",
    "daly_interval",
    "delete",
    "list_snapshots",
    "load",
    "read",
    "open_storage",
    "rng",
    "sampler",
    "save",
    "tiers",
    "trace",
    "verify",
    "young_interval",
]
