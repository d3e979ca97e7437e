"""The command line's ROOT and ID arguments: a root opened as storage, refusing up front a local
path that cannot be one, and a snapshot name (an id, a step, ``latest``) resolved to the id it
stands for, refused with the nearest ids or steps when it names nothing.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from trainsnap.errors import InvalidArgumentError, NotFoundError, TrainsnapError, listed

if TYPE_CHECKING:
    from trainsnap.storage import Storage

_ROOT_PARTS = ("snapshots", "objects", "lease", "events", "progress")
"""Folders a root holds: a path named like one of them inside a root is not itself a root."""


def _local_path(root: str) -> Path | None:
    """The directory a local ROOT names; None for a URL of another store (s3://, memory://)."""
    if root.startswith("file://"):
        return Path(urlparse(root).path)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", root):
        return None
    return Path(root)


def _not_a_root(root: str, path: Path) -> str | None:
    """Why the existing ``path`` cannot be a root (a file, a snapshot, a folder of a root)."""
    if not path.is_dir():
        kind = "a file" if path.is_file() else "not a directory"
        return (
            f"root {root} is {kind}: a root is the directory that holds snapshots/ and objects/ "
            "(the ROOT a training job saved to)"
        )
    parent = path.absolute().parent
    if parent.name == "snapshots" and any(
        p.name == "COMMITTED" or p.name.startswith("manifest") for p in _first_entries(path)
    ):
        owner = parent.parent
        return (
            f"{root} is the snapshot directory of snapshot {path.name}, not a root; its root is "
            f"{owner}: pass that, and {path.name} (or its step) as the snapshot where a command "
            "takes one"
        )
    if path.name in _ROOT_PARTS and any((parent / p).is_dir() for p in ("snapshots", "objects")):
        return f"{root} is the {path.name}/ folder of the root {parent}, not a root: pass {parent}"
    return None


def _first_entries(path: Path, limit: int = 64) -> list[Path]:
    """At most ``limit`` entries of the directory ``path``: enough to recognise a snapshot's,
    without listing a huge directory."""
    out: list[Path] = []
    with os.scandir(path) as entries:
        for entry in entries:
            out.append(Path(entry.path))
            if len(out) >= limit:
                break
    return out


_storage_options: dict[str, Any] = {}
"""The command's ``--storage-option`` pairs, for every root it opens (set once per command)."""


def parse_storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as the ``storage_options=`` of the Python API: VALUE as JSON when it
    parses (``true``, ``3``, ``{"region_name": "x"}``), else as the string given."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise InvalidArgumentError(
                f"--storage-option {pair!r} is not KEY=VALUE; e.g. "
                "--storage-option endpoint_url=http://127.0.0.1:9000"
            )
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        options[key.strip()] = value
    return options


def set_storage_options(options: dict[str, Any]) -> None:
    """The options :func:`open_root` and :func:`storage_options` give every root of this
    command."""
    _storage_options.clear()
    _storage_options.update(options)


def storage_options() -> dict[str, Any]:
    """The command's ``--storage-option`` pairs (a copy)."""
    return dict(_storage_options)


def open_root(root: str, *, create: bool = False) -> Storage:
    """The storage of ROOT, refusing up front a local path that is not a root: one that does
    not exist (unless ``create``: a command that writes a new root), a file, a snapshot's
    directory or a folder inside a root. Answering "no snapshots" there would hide the typo."""
    from trainsnap.storage import open_storage

    path = _local_path(root)
    if path is not None:
        if path.exists() or path.is_symlink():
            why = _not_a_root(root, path)
            if why:
                raise InvalidArgumentError(why, path=root)
        elif not create:
            raise NotFoundError(
                f"root {root} does not exist; check the path (a root is the directory a training "
                "job saved its snapshots to)",
                path=root,
            )
    return open_storage(root, **_storage_options)


_STEP_RE = re.compile(r"(?:step-?)?(\d{1,18})")


def resolve_snapshot(storage: Storage, name: str, *, committed_only: bool = True) -> str:
    """The snapshot id ``name`` stands for: ``latest``, a full id, or a step (``55`` or
    ``step-55``). A stored id is returned as is (opening it says what is wrong with it, if
    anything; ``committed_only`` asks for a committed one); a name that matches nothing is
    refused with the closest ids or steps."""
    from trainsnap.protocol import commit

    if name == "latest":
        return commit.resolve(storage, name)
    stored = commit.snapshot_ids(storage)
    if name in stored:
        if committed_only:
            commit.committed_marker(storage, name)  # uncommitted or damaged: its own error
        return name
    damaged: list[TrainsnapError] = []  # their ids are not candidates; verify reports them
    found = commit.list_committed(storage, damaged)
    step = _STEP_RE.fullmatch(name.strip().lower())
    if step:
        wanted = int(step.group(1))
        ids = [c.snapshot_id for c in found if c.step == wanted]
        if len(ids) == 1:
            return ids[0]
        if ids:
            raise InvalidArgumentError(
                f"step {wanted} has {len(ids)} committed snapshots in {storage.url} "
                f"({listed(ids)}): name one by its id",
                path=storage.url,
            )
        steps = sorted({c.step for c in found}, key=lambda s: (abs(s - wanted), s))[:3]
        near = f"; nearest saved step(s): {', '.join(map(str, sorted(steps)))}" if steps else ""
        raise NotFoundError(
            f"no committed snapshot of step {wanted} in {storage.url}{near}. "
            f"`trainsnap ls {storage.url}` lists them",
            path=storage.url,
        )
    close = difflib.get_close_matches(name, [c.snapshot_id for c in found], n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise NotFoundError(
        f"snapshot {name} does not exist in {storage.url}; {hint}"
        f"`trainsnap ls {storage.url}` lists the snapshots (ID may be an id, a step such as 55 "
        "or step-55, or 'latest')",
        path=storage.url,
        snapshot_id=name,
    )


def existing_snapshot(storage: Storage, snapshot_id: str) -> str:
    """The id ``snapshot_id`` names, refusing a malformed or absent one up front: verifying
    nothing is a usage error, while a snapshot that exists but is damaged is a finding."""
    from trainsnap.protocol import commit

    sid = resolve_snapshot(storage, snapshot_id, committed_only=False)
    try:
        commit.committed_marker(storage, sid)
    except NotFoundError:
        raise
    except TrainsnapError:
        pass  # uncommitted or damaged: verification reports it as a problem
    return sid
