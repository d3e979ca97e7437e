"""Reading a DCP ``.metadata`` pickle without running code from it.

``dcp.save`` writes its metadata with :mod:`pickle`, and a plain ``pickle.load`` of a crafted
file runs whatever it names. :func:`read_metadata` unpickles with an allow-list: torch's DCP
metadata classes, ``torch.Size``, torch dtypes, layouts and memory formats, paths, and plain
builtins; anything else is refused, naming it. ``trust=True`` is the old, unrestricted load, for
a checkpoint one trusts that holds something else.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Final

import torch

from trainsnap.errors import CorruptError, IncompatibleError

_ALLOWED: Final[dict[str, frozenset[str]]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "tuple", "list", "dict", "slice", "complex"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or _is_torch_constant(name)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def _is_torch_constant(name: str) -> bool:
    value = getattr(torch, name, None)
    return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


def read_metadata(path: Path, *, trust: bool = False) -> Any:
    """The ``Metadata`` object in the DCP ``.metadata`` file at ``path``."""
    data = path.read_bytes()
    try:
        if trust:
            return pickle.loads(data)
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        if trust:
            raise CorruptError(f"{path}: not a readable pickle ({e})", path=str(path)) from e
        raise IncompatibleError(
            f"{path} names {e}, which is not part of torch's DCP metadata: loading it would run "
            "code from the checkpoint. If you trust this checkpoint, import it with "
            "--trust-pickle (import_dcp(..., trust_pickle=True))",
            path=str(path),
        ) from e
