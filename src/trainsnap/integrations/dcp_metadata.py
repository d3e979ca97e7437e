"""Reading a DCP ``.metadata`` pickle without running code from it.

``dcp.save`` writes its metadata with :mod:`pickle`, and unpickling runs whatever the file names:
even an allow-list unpickler lets a crafted file ``BUILD`` on an allowed *class* (changing it for
the whole process) or call an allowed constructor with anything. :func:`read_metadata` does not
unpickle: a small opcode reader walks the pickle and builds only inert records (a global is a
name, a call is a record of its name and arguments, ``BUILD`` fills a record made in this file and
nothing else); then the records DCP writes -- ``Metadata``, ``TensorStorageMetadata``,
``TensorProperties``, ``ChunkStorageMetadata``, ``BytesStorageMetadata``, ``MetadataIndex``,
``StorageMeta``, ``_StorageInfo``, ``torch.Size``, dtypes, layouts, paths and plain builtins --
are turned into torch's own classes by calling their constructors with checked fields. Any other
opcode or name is refused, naming it. The reader is :mod:`~trainsnap.integrations._dcp_pickle`,
the records to classes :mod:`~trainsnap.integrations._dcp_records`; this module reads the file.

Bounds: the file is at most :data:`MAX_METADATA_BYTES` (checked with ``stat`` before reading, a
regular file opened non-blocking); every loop and allocation is bounded by the file's size (each
opcode makes at most one object; memo indices and marks are checked against what exists);
records nest at most :data:`MAX_DEPTH` deep and may not contain themselves.

``trust=True`` is the old, unrestricted ``pickle.load``, for a checkpoint one trusts that holds
something else.
"""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path
from typing import Any, Final

import torch

from trainsnap.errors import CorruptError, IncompatibleError
from trainsnap.integrations._dcp_pickle import Malformed, Refused, read_pickle
from trainsnap.integrations._dcp_records import (
    EXPANSION,
    EXPANSION_SLACK,
    MAX_DEPTH,
    Converter,
    check_shape,
)

__all__ = [
    "MAX_DEPTH",
    "MAX_METADATA_BYTES",
    "decode_metadata",
    "read_capped",
    "read_metadata",
    "safe_planner",
    "safe_reader",
]

MAX_METADATA_BYTES: Final = 1 << 30
"""Largest ``.metadata`` read (a model of 10^5 tensors in 10^3 chunks each writes ~100 MiB)."""


def read_capped(path: Path, cap: int) -> bytes:
    """The bytes of the regular file at ``path``, refused (:class:`CorruptError`) when it is
    larger than ``cap`` (checked with ``fstat`` before reading), not a regular file, or grows
    while read. Opened non-blocking, so that a FIFO planted there cannot block the reader."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CorruptError(f"{path}: cannot be opened ({e.strerror})", path=str(path)) from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptError(f"{path} is not a regular file", path=str(path))
        if info.st_size > cap:
            raise CorruptError(
                f"{path} is {info.st_size} bytes, more than such a file may be ({cap})",
                path=str(path),
            )
        chunks, total = [], 0
        while total <= info.st_size:
            chunk = os.read(fd, min(1 << 24, info.st_size + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total != info.st_size:
            raise CorruptError(f"{path} changed while it was read", path=str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def decode_metadata(data: bytes, where: str = ".metadata") -> Any:
    """DCP ``Metadata`` from the bytes of a ``.metadata`` file, without unpickling them:
    :class:`IncompatibleError` for anything outside what DCP writes, :class:`CorruptError`
    for a malformed pickle. O(len(data)) time and memory: shared references count by what they
    expand to (:data:`~trainsnap.integrations._dcp_records.EXPANSION`), and keys of one hash
    are bounded (:mod:`~trainsnap.format.flooding`)."""
    budget = EXPANSION * len(data) + EXPANSION_SLACK
    try:
        return check_shape(Converter(budget).value(read_pickle(data)))
    except Refused as e:
        raise IncompatibleError(
            f"{where} holds {e}, which is not part of torch's DCP metadata: reading it would "
            "run code from the checkpoint or is not what dcp.save writes. If you trust this "
            "checkpoint, import it with --trust-pickle (import_dcp(..., trust_pickle=True))",
            path=where,
        ) from None
    except Malformed as e:
        raise CorruptError(f"{where} is not a readable pickle: {e}", path=where) from None


def read_metadata(path: Path, *, trust: bool = False) -> Any:
    """The ``Metadata`` object in the DCP ``.metadata`` file at ``path`` (see the module)."""
    data = read_capped(path, MAX_METADATA_BYTES)
    if not trust:
        return decode_metadata(data, str(path))
    try:
        return pickle.loads(data)
    except Exception as e:
        raise CorruptError(f"{path}: not a readable pickle ({e})", path=str(path)) from e


def safe_reader(path: str | os.PathLike[str]) -> Any:
    """A DCP ``FileSystemReader`` for ``path`` whose metadata is read by :func:`read_metadata`
    (no unpickling); its tensor items are read by torch as usual (``torch.load`` with
    ``weights_only=True``)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(path)


def safe_planner() -> Any:
    """A DCP load planner whose non-tensor items are read by torch's restricted loader
    (``torch.load(..., weights_only=True)``: plain containers, numbers, strings, tensors) where
    torch's default planner unpickles them with ``weights_only=False``. An item that loader
    refuses is an :class:`IncompatibleError` naming it."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as e:  # whatever the restricted loader refuses
                raise IncompatibleError(
                    f"DCP item {fqn!r} is not plain data torch's restricted loader reads "
                    f"({type(e).__name__}); load that checkpoint with torch's own dcp.load "
                    "only if you trust it",
                    key=fqn,
                ) from e
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return _SafePlanner()
