"""trainsnap: crash-consistent, reshardable, verifiable snapshots of PyTorch training state.

The names in ``__all__`` are the stable API, together with :mod:`trainsnap.storage` (the storage
protocol and backends), :mod:`trainsnap.testing` (the multi-rank test harness) and
:mod:`trainsnap.integrations`. The layer packages below them (``format``, ``engine``, ``state``,
``protocol``, ``api``, ``manager``, ``tools``) are the implementation: importable, but with no
promise that their names stay.
"""

from trainsnap import trace
from trainsnap._version import __version__
from trainsnap.api.async_saver import AsyncSaver, SaveHandle
from trainsnap.api.options import SaveOptions
from trainsnap.api.snapshots import async_save, delete, list_snapshots, load, read, save
from trainsnap.api.verification import VerifyReport, verify
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
from trainsnap.manager import tiers
from trainsnap.manager.checkpoint_manager import CheckpointManager
from trainsnap.manager.options import LocalTier, ManagerOptions
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
