"""The pointer file :class:`~trainsnap.integrations.lightning.TrainsnapCheckpointIO` writes at the
``.ckpt`` path Lightning chose: which snapshot of which root holds that checkpoint.

The file is a valid ``torch.save`` archive whose pickle refuses to load as a checkpoint
(:class:`TrainsnapPointerFile`), with the pointer as a JSON record (:data:`POINTER_RECORD`)
beside it: :func:`read_pointer` reads that record without unpickling, bounded by
:data:`POINTER_MAX_BYTES`; :func:`write_pointer` replaces the file atomically. Paths may be
local or any fsspec URL (``memory://``, ``s3://``); the helpers here treat both alike.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import stat
import zipfile
from typing import Any

import torch

from trainsnap.errors import IncompatibleError, NotFoundError
from trainsnap.storage import Root

POINTER_FORMAT = "trainsnap.pointer"
POINTER_RECORD = "trainsnap_pointer.json"
"""The archive record of a pointer file that holds the pointer as JSON."""
POINTER_MAX_BYTES = 64 * 1024
"""A pointer file (and its JSON record) larger than this is refused before it is read."""


class CheckpointNotFoundError(NotFoundError, FileNotFoundError):
    """No checkpoint at the path Lightning asked for: a trainsnap ``NotFoundError`` that is also
    the ``FileNotFoundError`` Lightning's ``CheckpointIO`` contract names."""


class TrainsnapPointerFile:
    """What ``torch.load`` of a pointer file unpickles: constructing it raises, saying how to
    load the checkpoint the pointer names (``weights_only=True`` refuses the class by name)."""

    def __init__(self, pointer: dict[str, Any]) -> None:
        raise IncompatibleError(
            "this .ckpt is a trainsnap pointer to snapshot "
            f"{pointer.get('snapshot')} of root {pointer.get('root')}, not a Lightning "
            "checkpoint: load it with trainsnap.integrations.lightning.load_from_checkpoint("
            "MyModule, path), or with Trainer(plugins=[TrainsnapCheckpointIO()]).fit(..., "
            "ckpt_path=path); trainsnap.read(root, snapshot) gives the checkpoint dict",
            snapshot_id=str(pointer.get("snapshot")),
        )


# The name pointer files hold (torch.load finds the class there): every pointer written names it.
TrainsnapPointerFile.__module__ = "trainsnap.integrations.lightning"


class _TorchLoadRefusal:
    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return TrainsnapPointerFile, (self.doc,)


def path_text(path: Any) -> str:
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    if text.startswith("file://"):
        return text[len("file://") :]
    return text


def is_url(text: str) -> bool:
    return "://" in text


def parent_of(text: str) -> str:
    if is_url(text):
        return text.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(text) or "."


def name_of(text: str) -> str:
    return text.rstrip("/").rsplit("/", 1)[-1] if is_url(text) else os.path.basename(text)


def join_path(parent: str, name: str) -> str:
    return f"{parent.rstrip('/')}/{name}" if is_url(parent) else os.path.join(parent, name)


def _fs(text: str, options: dict[str, Any]) -> tuple[Any, str]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(text, **options)
    return fs, path


def path_exists(text: str, options: dict[str, Any]) -> bool:
    if not is_url(text):
        return os.path.lexists(text)
    fs, path = _fs(text, options)
    return bool(fs.exists(path))


def is_link(text: str) -> bool:
    return not is_url(text) and os.path.islink(text)


def remove_path(text: str, options: dict[str, Any]) -> None:
    if not is_url(text):
        os.unlink(text)
        return
    fs, path = _fs(text, options)
    fs.rm_file(path)


def same_root(a: Root, b: Root) -> bool:
    def norm(root: Root) -> str:
        text = path_text(root)
        return text.rstrip("/") if is_url(text) else os.path.realpath(text)

    return norm(a) == norm(b)


def _pointer_bytes(root: Root, snapshot_id: str, step: int, pointer: str) -> bytes:
    """A ``torch.save`` archive whose pickle refuses to load as a checkpoint, with the pointer
    as a JSON record beside it (the record is what trainsnap reads)."""
    root_text = path_text(root)
    parent = parent_of(pointer)
    if is_url(root_text) == is_url(parent):
        # Kept relative to the pointer when the root is next to it: the folder can move.
        base = parent.rstrip("/") if is_url(parent) else os.path.abspath(parent)
        full = root_text.rstrip("/") if is_url(root_text) else os.path.abspath(root_text)
        if full.startswith(base + "/"):
            root_text = full[len(base) + 1 :]
    doc = {"format": POINTER_FORMAT, "root": root_text, "snapshot": snapshot_id, "step": step}
    buffer = io.BytesIO()
    torch.save(_TorchLoadRefusal(doc), buffer)
    with zipfile.ZipFile(buffer, "a") as archive:
        prefix = archive.namelist()[0].split("/", 1)[0]
        archive.writestr(f"{prefix}/{POINTER_RECORD}", json.dumps(doc))
    return buffer.getvalue()


def write_pointer(
    pointer: str, root: Root, snapshot_id: str, step: int, options: dict[str, Any]
) -> None:
    """The pointer, atomically: a reader sees the old one, the new one, or none."""
    data = _pointer_bytes(root, snapshot_id, step, pointer)
    if is_url(pointer):  # an object store's PUT is whole; fsspec's memory store too
        fs, path = _fs(pointer, options)
        fs.makedirs(fs._parent(path), exist_ok=True)
        fs.pipe_file(path, data)
        return
    parent = parent_of(pointer)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name_of(pointer)}.tmp-{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, pointer)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def _read_bounded(text: str, options: dict[str, Any]) -> bytes:
    """The bytes of the pointer file ``text``: a regular file of at most
    :data:`POINTER_MAX_BYTES`, checked before reading; a FIFO or device is refused, never
    waited on."""
    if is_url(text):
        fs, path = _fs(text, options)
        try:
            info = fs.info(path)
        except FileNotFoundError:
            raise _not_found(text) from None
        if info.get("type") != "file" or int(info.get("size") or 0) > POINTER_MAX_BYTES:
            raise _not_a_pointer(text, f"a {info.get('type')} of {info.get('size')} bytes")
        data = bytes(fs.cat_file(path, start=0, end=POINTER_MAX_BYTES + 1))
    else:
        try:
            fd = os.open(text, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except (FileNotFoundError, NotADirectoryError):
            raise _not_found(text) from None
        except IsADirectoryError:
            raise _not_a_pointer(text, "a directory") from None
        try:  # checked on the descriptor, closed on every path (a directory opens on Linux)
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise _not_a_pointer(text, "a directory")
            if not stat.S_ISREG(st.st_mode):
                raise _not_a_pointer(text, "not a regular file (a FIFO, a device?)")
            if st.st_size > POINTER_MAX_BYTES:
                raise _not_a_pointer(text, f"{st.st_size} bytes")
            data = os.read(fd, POINTER_MAX_BYTES + 1)
        finally:
            os.close(fd)
    if len(data) > POINTER_MAX_BYTES:
        raise _not_a_pointer(text, f"more than {POINTER_MAX_BYTES} bytes")
    return data


def _pointer_doc(data: bytes) -> Any:
    """The pointer's JSON document: the record of a pointer archive, or (pointers written by
    earlier versions) the whole file. None when neither is there."""
    if data.startswith(b"PK"):
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                names = [n for n in archive.namelist() if n.endswith("/" + POINTER_RECORD)]
                if len(names) != 1 or archive.getinfo(names[0]).file_size > POINTER_MAX_BYTES:
                    return None
                with archive.open(names[0]) as record:
                    data = record.read(POINTER_MAX_BYTES + 1)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
            return None
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


def read_pointer(pointer: Any, storage_options: dict[str, Any] | None = None) -> tuple[str, str]:
    """(root, snapshot id) a checkpoint path points to. ``CheckpointNotFoundError`` when no file
    is there; ``IncompatibleError`` when the file is not a pointer (a torch checkpoint, a FIFO,
    a file over :data:`POINTER_MAX_BYTES`, a root holding a NUL byte). O(size of the pointer),
    bounded."""
    text = path_text(pointer)
    doc = _pointer_doc(_read_bounded(text, dict(storage_options or {})))
    if not (
        isinstance(doc, dict)
        and doc.get("format") == POINTER_FORMAT
        and isinstance(doc.get("root"), str)
        and isinstance(doc.get("snapshot"), str)
    ):
        raise _not_a_pointer(text, "no trainsnap pointer in it (a torch.save checkpoint?)")
    root = doc["root"]
    if "\0" in root or "\0" in doc["snapshot"]:  # no path or URL holds one: a crafted file
        raise _not_a_pointer(text, "its root or snapshot holds a NUL byte")
    if not (is_url(root) or os.path.isabs(root)):
        root = join_path(parent_of(text), root)
    return root, doc["snapshot"]


def _not_found(text: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"Checkpoint file not found: {text}. Give the path of a .ckpt that "
        "TrainsnapCheckpointIO saved (ckpt_path='last' finds the newest)",
        path=text,
    )


def _not_a_pointer(text: str, why: str) -> IncompatibleError:
    return IncompatibleError(
        f"{text} is not a trainsnap checkpoint pointer ({why}); load a torch.save checkpoint "
        "with Lightning's default CheckpointIO, or save it again through TrainsnapCheckpointIO",
        path=text,
    )
