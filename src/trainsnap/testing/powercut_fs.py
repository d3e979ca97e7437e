"""The power-cut file system's model and its FUSE daemon (standard library and mfusepy only, so
that the daemon starts as a plain script without importing torch).

The model keeps, for every inode, a volatile state (what a process sees) and a durable state
(what survives a power cut) under the strict POSIX rule:

- a file's data is durable only after ``fsync``/``fdatasync`` of that file;
- a created, renamed, linked or removed name is durable only after ``fsync`` of its parent
  directory (each directory keeps its own durable entries: a rename between two directories is
  durable in each only once each is synced).

Every mutating operation is one event of a trace, applied in the order the daemon served it (a
valid serialisation of the writers' threads). The durable state after the first ``n`` events is
a function of that prefix only, so one run of a workload gives every cut point
(:func:`replay`); a torn cut also keeps a random prefix of the changes still unsynced there.
Metadata other than names and data (times, owners) is not modelled; a mode is durable at once.
"""

from __future__ import annotations

import copy
import errno
import os
import random
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = 1
_NOT_PASSED = os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_APPEND
"""Open flags the backing file does not get: the kernel resolved them (an append's offset comes
with each write)."""
Event = tuple[Any, ...]
"""``(kind, ...)``: ``write ino off data`` · ``trunc ino size`` · ``new parent name ino kind mode
target`` · ``unlink parent name`` · ``rename p1 n1 p2 n2 ino`` · ``link parent name ino`` · ``fsync
ino`` · ``chmod ino mode``. ``fsync`` of a directory syncs its entries."""


@dataclass(slots=True)
class Node:
    kind: str  # "f" file, "d" directory, "l" symbolic link
    mode: int
    data: bytearray = field(default_factory=bytearray)
    entries: dict[str, int] = field(default_factory=dict)
    durable_data: bytes = b""
    durable_entries: dict[str, int] = field(default_factory=dict)


class Model:
    """Volatile and durable state of one file system; :meth:`apply` takes one event."""

    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {ROOT: Node("d", 0o755)}
        self.next_ino = ROOT + 1

    @classmethod
    def scan(cls, directory: Path) -> Model:
        """Everything under ``directory``, all of it durable (the state at mount time)."""
        model = cls()
        model.nodes[ROOT].mode = os.stat(directory).st_mode & 0o7777
        model._scan(directory, ROOT)
        return model

    def _scan(self, directory: Path, parent: int) -> None:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            st = entry.stat(follow_symlinks=False)
            ino = self.new_ino()
            if entry.is_symlink():
                node = Node("l", 0o777, durable_data=os.readlink(entry.path).encode())
                node.data = bytearray(node.durable_data)
            elif entry.is_dir(follow_symlinks=False):
                node = Node("d", st.st_mode & 0o7777)
                self.nodes[ino] = node
                self._scan(Path(entry.path), ino)
            else:
                node = Node("f", st.st_mode & 0o7777, durable_data=Path(entry.path).read_bytes())
                node.data = bytearray(node.durable_data)
            self.nodes[ino] = node
            self.nodes[parent].entries[entry.name] = ino
        self.nodes[parent].durable_entries = dict(self.nodes[parent].entries)

    def to_wire(self) -> tuple[int, dict[int, tuple[Any, ...]]]:
        """Plain data (the daemon runs as ``__main__``: its classes do not unpickle elsewhere)."""
        return self.next_ino, {
            i: (n.kind, n.mode, bytes(n.data), n.entries, n.durable_data, n.durable_entries)
            for i, n in self.nodes.items()
        }

    @classmethod
    def from_wire(cls, wire: tuple[int, dict[int, tuple[Any, ...]]]) -> Model:
        model = cls()
        model.next_ino = wire[0]
        model.nodes = {
            i: Node(k, m, bytearray(d), dict(e), dd, dict(de))
            for i, (k, m, d, e, dd, de) in wire[1].items()
        }
        return model

    def new_ino(self) -> int:
        self.next_ino += 1
        return self.next_ino - 1

    def resolve(self, path: str) -> int:
        """The inode a path names now (volatile state); FileNotFoundError if none."""
        ino = ROOT
        for part in path.strip("/").split("/"):
            if not part:
                continue
            node = self.nodes[ino]
            if node.kind != "d" or part not in node.entries:
                raise FileNotFoundError(errno.ENOENT, "no such entry", path)
            ino = node.entries[part]
        return ino

    def parent_of(self, path: str) -> tuple[int, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        return self.resolve(head or "/"), name

    def apply(self, ev: Event) -> None:
        kind, nodes = ev[0], self.nodes
        if kind == "write":
            data = nodes[ev[1]].data
            off, chunk = ev[2], ev[3]
            if len(data) < off:
                data.extend(bytes(off - len(data)))
            data[off : off + len(chunk)] = chunk
        elif kind == "trunc":
            data = nodes[ev[1]].data
            del data[ev[2] :]
            data.extend(bytes(ev[2] - len(data)))
        elif kind == "new":
            _, parent, name, ino, node_kind, mode, target = ev
            node = Node(node_kind, mode)
            if node_kind == "l":  # a link's target is part of its inode
                node.data = bytearray(target)
                node.durable_data = target
            nodes[ino] = node
            nodes[parent].entries[name] = ino
        elif kind == "unlink":
            nodes[ev[1]].entries.pop(ev[2], None)
        elif kind == "rename":
            ino = nodes[ev[1]].entries.pop(ev[2])
            nodes[ev[3]].entries[ev[4]] = ino
        elif kind == "link":
            nodes[ev[1]].entries[ev[2]] = ev[3]
        elif kind == "fsync":
            node = nodes[ev[1]]
            if node.kind == "d":
                node.durable_entries = dict(node.entries)
            else:
                node.durable_data = bytes(node.data)
        elif kind == "chmod":
            nodes[ev[1]].mode = ev[2]
        else:
            raise ValueError(f"unknown event {ev!r}")


def _affects(ev: Event) -> tuple[int, ...]:
    """The inodes whose durable state an event changes once synced."""
    if ev[0] in ("write", "trunc"):
        return (ev[1],)
    if ev[0] in ("new", "unlink", "link"):
        return (ev[1],)
    if ev[0] == "rename":
        return (ev[1], ev[3])
    return ()


def _tear(model: Model, pending: list[Event], rng: random.Random) -> dict[int, Node]:
    """Durable nodes plus a random prefix of the unsynced changes, as a disk that wrote some of
    its cache back in order before the power went."""
    nodes = {i: copy.copy(n) for i, n in model.nodes.items()}
    for ev in pending[: rng.randint(0, len(pending))]:
        kind = ev[0]
        if kind in ("write", "trunc"):
            node = nodes[ev[1]]
            data = bytearray(node.durable_data)
            if kind == "write":
                off = ev[2]
                data.extend(bytes(max(0, off - len(data))))
                data[off : off + len(ev[3])] = ev[3]
            else:
                del data[ev[2] :]
                data.extend(bytes(ev[2] - len(data)))
            node.durable_data = bytes(data)
        else:
            changed = {p: dict(nodes[p].durable_entries) for p in _affects(ev)}
            if kind == "rename":
                changed[ev[1]].pop(ev[2], None)
                changed[ev[3]][ev[4]] = ev[5]
            elif kind == "unlink":
                changed[ev[1]].pop(ev[2], None)
            else:
                changed[ev[1]][ev[2]] = ev[3]
            for p, entries in changed.items():
                nodes[p].durable_entries = entries
    return nodes


def materialize(nodes: dict[int, Node], dest: Path) -> None:
    """Write the durable state of ``nodes`` into the empty directory ``dest``."""
    placed: dict[int, str] = {}

    def walk(ino: int, path: Path, seen: frozenset[int]) -> None:
        for name, child in sorted(nodes[ino].durable_entries.items()):
            node = nodes.get(child)
            target = path / name
            if node is None:
                continue
            if node.kind == "d":
                if child in seen or child in placed:
                    continue  # a directory reachable twice (torn renames): its first place
                placed[child] = str(target)
                target.mkdir()
                walk(child, target, seen | {child})
                os.chmod(target, node.mode)
            elif node.kind == "l":
                os.symlink(node.durable_data.decode(), target)
            elif child in placed:
                os.link(placed[child], target)
            else:
                target.write_bytes(node.durable_data)
                os.chmod(target, node.mode)
                placed[child] = str(target)

    walk(ROOT, dest, frozenset({ROOT}))
    os.chmod(dest, nodes[ROOT].mode)


def replay(
    initial: Model, events: list[Event], points: Iterable[int], torn: int | None = None
) -> Iterator[tuple[int, dict[int, Node]]]:
    """``(n, durable nodes after the first n events)`` for each of ``points`` (ascending), in
    one pass. With ``torn`` (a seed), each also keeps a random prefix of what is unsynced."""
    model = copy.deepcopy(initial)
    pending: list[Event] = []
    done = 0
    rng = random.Random(torn)
    for n in sorted(set(points)):
        while done < min(n, len(events)):
            ev = events[done]
            model.apply(ev)
            if ev[0] == "fsync":
                pending = [p for p in pending if ev[1] not in _affects(p)]
            elif _affects(ev):
                pending.append(ev)
            done += 1
        if torn is None:
            yield n, model.nodes
        else:
            yield n, _tear(model, pending, rng)


# -- the FUSE daemon -------------------------------------------------------------------------


class Daemon:
    """Pass-through operations over ``backing`` that record each mutation in the model.

    A cut (after event ``cut_after`` or on command) makes every later operation fail with EIO;
    ``rules`` inject an error into operations whose path contains a string."""

    def __init__(self, backing: Path) -> None:
        self.backing = backing
        self.lock = threading.RLock()
        self.initial = Model.scan(backing)
        self.model = copy.deepcopy(self.initial)
        self.events: list[Event] = []
        self.handles: dict[int, int] = {}
        self.cut_after: int | None = None
        self.dead = False
        self.rules: list[dict[str, Any]] = []

    def real(self, path: str) -> str:
        return str(self.backing) + path

    def check(self, op: str, path: str) -> None:
        if self.dead:
            raise OSError(errno.EIO, "power cut", path)
        for rule in self.rules:
            if rule["op"] == op and rule["match"] in path and rule["times"] != 0:
                rule["times"] -= 1
                rule["hits"] += 1
                raise OSError(rule["errno"], os.strerror(rule["errno"]), path)

    def record(self, ev: Event) -> None:
        self.model.apply(ev)
        self.events.append(ev)
        if self.cut_after is not None and len(self.events) >= self.cut_after:
            self.dead = True

    def control(self, request: tuple[Any, ...]) -> Any:
        with self.lock:
            kind = request[0]
            if kind == "count":
                return len(self.events)
            if kind == "arm":
                self.cut_after = request[1]
                self.dead = self.dead or len(self.events) >= request[1]
                return len(self.events)
            if kind == "cut":
                self.dead = True
                return len(self.events)
            if kind == "fail":
                self.rules.append(dict(request[1], hits=0))
                return len(self.rules)
            if kind == "hits":
                return [r["hits"] for r in self.rules]
            if kind == "trace":
                return self.initial.to_wire(), list(self.events)
            raise ValueError(f"unknown request {request!r}")


def operations(daemon: Daemon) -> Any:
    import mfusepy as fuse

    d = daemon

    def guarded(op: str):  # type: ignore[no-untyped-def]
        def wrap(fn):  # type: ignore[no-untyped-def]
            def run(self, path, *args):  # type: ignore[no-untyped-def]
                with d.lock:
                    try:
                        d.check(op, path or "")
                        return fn(self, path, *args)
                    except OSError as e:
                        raise fuse.FuseOSError(e.errno or errno.EIO) from None

            return run

        return wrap

    class Ops(fuse.Operations):  # type: ignore[misc]
        use_ns = True

        @guarded("getattr")
        def getattr(self, path, fh=None):  # type: ignore[no-untyped-def]
            st = os.lstat(d.real(path))
            keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino")
            out = {k: getattr(st, k) for k in keys}
            for k in ("st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
                out[k[:-3]] = getattr(st, k)
            return out

        @guarded("readdir")
        def readdir(self, path, fh):  # type: ignore[no-untyped-def]
            return [".", "..", *os.listdir(d.real(path))]

        @guarded("readlink")
        def readlink(self, path):  # type: ignore[no-untyped-def]
            return os.readlink(d.real(path))

        @guarded("statfs")
        def statfs(self, path):  # type: ignore[no-untyped-def]
            sv = os.statvfs(d.real(path))
            return {k: getattr(sv, k) for k in dir(sv) if k.startswith("f_") and k != "f_fsid"}

        @guarded("open")
        def open(self, path, flags):  # type: ignore[no-untyped-def]
            fh = os.open(d.real(path), flags & ~_NOT_PASSED)
            d.handles[fh] = d.model.resolve(path)
            if flags & os.O_TRUNC:
                d.record(("trunc", d.handles[fh], 0))
            return fh

        @guarded("create")
        def create(self, path, mode, flags=os.O_WRONLY):  # type: ignore[no-untyped-def]
            try:
                ino = d.model.resolve(path)
            except FileNotFoundError:
                ino = None
            fh = os.open(d.real(path), (flags & ~(os.O_DIRECT | os.O_APPEND)) | os.O_CREAT, mode)
            if ino is None:
                parent, name = d.model.parent_of(path)
                ino = d.model.new_ino()
                d.record(("new", parent, name, ino, "f", mode & 0o7777, b""))
            elif flags & os.O_TRUNC:
                d.record(("trunc", ino, 0))
            d.handles[fh] = ino
            return fh

        @guarded("read")
        def read(self, path, size, offset, fh):  # type: ignore[no-untyped-def]
            return os.pread(fh, size, offset)

        @guarded("write")
        def write(self, path, data, offset, fh):  # type: ignore[no-untyped-def]
            n = os.pwrite(fh, data, offset)
            d.record(("write", d.handles[fh], offset, bytes(data[:n])))
            return n

        @guarded("truncate")
        def truncate(self, path, length, fh=None):  # type: ignore[no-untyped-def]
            if fh is not None:
                os.ftruncate(fh, length)
                ino = d.handles[fh]
            else:
                os.truncate(d.real(path), length)
                ino = d.model.resolve(path)
            d.record(("trunc", ino, length))

        @guarded("fsync")
        def fsync(self, path, datasync, fh):  # type: ignore[no-untyped-def]
            d.record(("fsync", d.handles[fh]))

        @guarded("fsyncdir")
        def fsyncdir(self, path, datasync, fh):  # type: ignore[no-untyped-def]
            d.record(("fsync", d.model.resolve(path)))

        @guarded("release")
        def release(self, path, fh):  # type: ignore[no-untyped-def]
            d.handles.pop(fh, None)
            os.close(fh)

        @guarded("mkdir")
        def mkdir(self, path, mode):  # type: ignore[no-untyped-def]
            os.mkdir(d.real(path), mode)
            parent, name = d.model.parent_of(path)
            d.record(("new", parent, name, d.model.new_ino(), "d", mode & 0o7777, b""))

        @guarded("symlink")
        def symlink(self, target, source):  # type: ignore[no-untyped-def]
            os.symlink(source, d.real(target))
            parent, name = d.model.parent_of(target)
            d.record(("new", parent, name, d.model.new_ino(), "l", 0o777, source.encode()))

        @guarded("unlink")
        def unlink(self, path):  # type: ignore[no-untyped-def]
            os.unlink(d.real(path))
            d.record(("unlink", *d.model.parent_of(path)))

        @guarded("rmdir")
        def rmdir(self, path):  # type: ignore[no-untyped-def]
            os.rmdir(d.real(path))
            d.record(("unlink", *d.model.parent_of(path)))

        @guarded("rename")
        def rename(self, old, new):  # type: ignore[no-untyped-def]
            ino = d.model.resolve(old)
            os.rename(d.real(old), d.real(new))
            d.record(("rename", *d.model.parent_of(old), *d.model.parent_of(new), ino))

        @guarded("link")
        def link(self, target, source):  # type: ignore[no-untyped-def]
            os.link(d.real(source), d.real(target))
            d.record(("link", *d.model.parent_of(target), d.model.resolve(source)))

        @guarded("chmod")
        def chmod(self, path, mode):  # type: ignore[no-untyped-def]
            os.chmod(d.real(path), mode)
            d.record(("chmod", d.model.resolve(path), mode & 0o7777))

        @guarded("chown")
        def chown(self, path, uid, gid):  # type: ignore[no-untyped-def]
            os.chown(d.real(path), uid, gid, follow_symlinks=False)

        @guarded("utimens")
        def utimens(self, path, times=None):  # type: ignore[no-untyped-def]
            if times is None:
                os.utime(d.real(path), follow_symlinks=False)
            else:
                os.utime(d.real(path), ns=times, follow_symlinks=False)

        @guarded("access")
        def access(self, path, amode):  # type: ignore[no-untyped-def]
            if not os.access(d.real(path), amode, follow_symlinks=False):
                raise OSError(errno.EACCES, "access denied", path)

    return Ops()


def serve(backing: str, mountpoint: str, address: str, authkey_hex: str) -> None:
    """Mount, then answer control requests on ``address`` until unmounted."""
    from multiprocessing.connection import Listener

    import mfusepy as fuse

    daemon = Daemon(Path(backing))
    listener = Listener(address, family="AF_UNIX", authkey=bytes.fromhex(authkey_hex))

    def answer() -> None:
        while True:
            try:
                conn = listener.accept()
            except OSError:
                return
            with conn:
                while True:
                    try:
                        request = conn.recv()
                    except (EOFError, OSError):
                        break
                    try:
                        conn.send(("ok", daemon.control(request)))
                    except Exception as e:  # a bad request is the caller's to see
                        conn.send(("error", repr(e)))

    threading.Thread(target=answer, daemon=True, name="powercut-control").start()
    options = {"attr_timeout": 0, "entry_timeout": 0, "negative_timeout": 0}
    fuse.FUSE(
        operations(daemon),
        mountpoint,
        foreground=True,
        direct_io=True,
        fsname="powercut",
        **options,
    )
    listener.close()


if __name__ == "__main__":
    serve(*sys.argv[1:5])
