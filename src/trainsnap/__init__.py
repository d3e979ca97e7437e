"""trainsnap: crash-consistent, reshardable, verifiable snapshots of PyTorch training state."""

from . import data, rng, tier, trace
from ._version import __version__
from .asyncsave import AsyncSaver, SaveHandle
from .capture import Sharded
from .errors import (
    CommitFailedError,
    CorruptError,
    IncompatibleError,
    IncompleteError,
    InvalidArgumentError,
    NotFoundError,
    TrainsnapError,
)
from .manager import CheckpointManager
from .policy import (
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
from .snapshot import SnapshotInfo, list_snapshots, load, save
from .storage import open_storage
from .trainstate import TrainState
from .verify import VerifyReport, verify

__all__ = [
    "CheckpointManager",
    "Every",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepTagged",
    "StepInfo",
    "YoungDaly",
    "daly_interval",
    "young_interval",
    "AsyncSaver",
    "CommitFailedError",
    "CorruptError",
    "IncompatibleError",
    "IncompleteError",
    "InvalidArgumentError",
    "NotFoundError",
    "SaveHandle",
    "Sharded",
    "SnapshotInfo",
    "TrainState",
    "TrainsnapError",
    "VerifyReport",
    "__version__",
    "data",
    "list_snapshots",
    "load",
    "open_storage",
    "rng",
    "tier",
    "trace",
    "save",
    "verify",
]
