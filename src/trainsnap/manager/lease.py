"""Who may commit to a root (fencing), and the root's restart log.

Generations: a job that opens a root for writing creates ``lease/gen-<N+1>`` (create-if-absent,
so two jobs starting at once get different numbers) and takes over at once, never waiting for
the previous holder, which may be dead. That numbering holds only if the store refuses a create of
an existing key, so the first take of a root in a process checks it does (:func:`check_fencing`)
and refuses a store that ignores the condition. Before each commit the writer checks that no newer
generation exists: a writer that survived its own replacement (a zombie after a preemption or a
partition) can never commit once a newer one took over. ``close()`` writes
``lease/released-<N>``: the collector then knows that no writer is active.

The restart log ``events/`` holds one small object per event (start, restore, save, preempt,
close). A generation whose last event is not ``close`` or ``preempt`` ended in a crash; the
time between crashes across generations gives the observed MTBF used by ``YoungDaly``.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Final

from trainsnap.errors import CommitFailedError, InvalidArgumentError, TrainsnapError
from trainsnap.storage.base import NotRegularFileError, Storage

log = logging.getLogger(__name__)

_GEN = "lease/gen-"
_REL = "lease/released-"
_PROBE = "lease/probe-"

MAX_ADVISORY_BYTES: Final = 64 << 10
"""Largest event, progress record or lease entry read (trainsnap writes a few hundred bytes):
a larger one is skipped unread, so a crafted or sparse file cannot make a reader allocate by its
claimed size."""
MAX_GENERATION: Final = 10**15
"""Largest writer generation believed (one per job start: far beyond any real job)."""
MAX_TIME: Final = 1e11
"""Latest event time believed (seconds since the epoch, year 5138): later ones are malformed."""

_warned: set[str] = set()


def _skip(storage: Storage, key: str, why: str) -> None:
    """Warn, once per process and key, that the advisory file ``key`` is skipped: the restart
    log, progress and lease never stop training, but a user should learn one was damaged."""
    if key not in _warned:
        _warned.add(key)
        log.warning("skipping %s/%s (%s): it is advisory, training goes on", storage.url, key, why)


def _generation_of(name: str) -> int | None:
    """The generation a lease or progress file name carries, if it is a plain number in range."""
    if not (name.isascii() and name.isdigit()) or len(name) > 16:
        return None
    value = int(name)
    return value if 0 < value <= MAX_GENERATION else None


def _gens(storage: Storage) -> list[int]:
    out = []
    for key in storage.list("lease/"):
        if key.startswith(_GEN):
            generation = _generation_of(key[len(_GEN) :])
            if generation is None:
                _skip(storage, key, "not a generation number")
                continue
            out.append(generation)
    return sorted(out)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


def read_advisory(storage: Storage, key: str) -> dict[str, Any] | None:
    """The JSON object stored under ``key`` (an event, a progress record, a lease entry), or
    None, with a warning naming it, when it is missing, not a regular file, larger than
    :data:`MAX_ADVISORY_BYTES` (checked with ``stat`` before reading), or not a JSON object
    (NaN and infinities included). Reads at most :data:`MAX_ADVISORY_BYTES`; never raises."""
    try:
        size = storage.stat(key)
        if size > MAX_ADVISORY_BYTES:
            _skip(storage, key, f"{size} bytes, more than the {MAX_ADVISORY_BYTES} allowed")
            return None
        data = storage.get(key, 0, size) if size else b""
        doc = json.loads(data, parse_constant=_reject_constant)
    except NotRegularFileError as e:  # a FIFO, a device, a link: never opened
        _skip(storage, key, f"not a regular file: {e.strerror}")
        return None
    except FileNotFoundError:
        return None  # removed since listed (a generation pruned)
    except (OSError, ValueError, RecursionError) as e:
        _skip(storage, key, f"{type(e).__name__}: {e}")
        return None
    if not isinstance(doc, dict):
        _skip(storage, key, f"a JSON {type(doc).__name__}, not an object")
        return None
    return doc


def current_generation(storage: Storage) -> int:
    gens = _gens(storage)
    return gens[-1] if gens else 0


def is_released(storage: Storage, generation: int) -> bool:
    try:
        storage.stat(f"{_REL}{generation:012d}")
    except FileNotFoundError:
        return False
    return True


def released_newest(storage: Storage, generation: int) -> str | None:
    """The newest snapshot the released writer ``generation`` committed, if it said."""
    doc = read_advisory(storage, f"{_REL}{generation:012d}")
    newest = doc.get("newest") if doc is not None else None
    return newest if isinstance(newest, str) else None


def active_writer(storage: Storage) -> int | None:
    """The generation holding the root, or None when the newest one released it (or none
    ever took it)."""
    g = current_generation(storage)
    if g == 0 or is_released(storage, g):
        return None
    return g


@dataclass(slots=True)
class Lease:
    storage: Storage
    generation: int

    @staticmethod
    def take(storage: Storage, *, single_writer: bool = False) -> Lease:
        """Take the root over now: the next free generation is ours.

        First checks that the store honours conditional creates (:func:`check_fencing`); a
        store that does not is refused with an :class:`InvalidArgumentError`, unless
        ``single_writer`` (the caller promises that no two jobs ever write this root at once)
        makes that a warning."""
        try:
            check_fencing(storage, single_writer=single_writer)
            g = current_generation(storage) + 1
            owner = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
            while not storage.put_if_absent(f"{_GEN}{g:012d}", json.dumps(owner).encode()):
                g += 1  # another job took this one at the same moment
        except TrainsnapError:
            raise  # the store's own account (a refused or unavailable store names itself)
        except OSError as e:
            raise _not_writable(storage, e) from e
        for old in _gens(storage):
            if old < g - 8:  # keep a short history; generations only ever grow
                storage.delete(f"{_GEN}{old:012d}")
                storage.delete(f"{_REL}{old:012d}")
        log.info("took over %s as writer generation %d", storage.url, g)
        return Lease(storage, g)

    def check(self) -> None:
        """Raise unless we are still the newest writer (called before each commit)."""
        newest = current_generation(self.storage)
        if newest != self.generation:
            raise CommitFailedError(
                f"this writer (generation {self.generation}) was superseded by generation "
                f"{newest} on {self.storage.url}: a newer job took the root over. This save is "
                "not committed, and no save of this writer ever will be; stop this process."
            )

    def release(self, newest: str | None = None) -> None:
        """Release the root, naming the newest snapshot this writer committed: a collector that
        then lists the root must find it, or its listing is stale (eventual consistency) and it
        must not decide what is garbage from it."""
        body = json.dumps({"newest": newest, "time": time.time()}).encode()
        self.storage.put(f"{_REL}{self.generation:012d}", body)


def _not_writable(storage: Storage, error: OSError) -> InvalidArgumentError:
    """The error of a root the manager cannot write (a read-only mount, no permission, a store
    that refuses the credentials): it names the root and what to do."""
    code = errno.errorcode.get(error.errno or 0, "")
    why = f"{error.strerror or error}" + (f" ({code})" if code else "")
    return InvalidArgumentError(
        f"cannot write to {storage.url}: {why}. A CheckpointManager writes its snapshots, its "
        "writer lease and its restart log there: give it a root this process may write (a "
        "read-write mount, the permissions or credentials to write), or read the snapshots "
        "there with ts.load, ts.read or ts.list_snapshots, which never write.",
        path=storage.url,
    )


def check_fencing(storage: Storage, *, single_writer: bool = False) -> None:
    """Check that ``storage`` refuses to create a key that exists, on a scratch key of its own
    (``lease/probe-<random>``, deleted after): create it, try to create it again with other
    bytes, read it back. Generations fence a superseded writer only on a store that does; an
    old S3 gateway or an S3-compatible appliance that ignores ``If-None-Match`` would let two
    jobs take the same generation and both commit.

    Raises :class:`InvalidArgumentError` naming the store and the fix when it does not, unless
    ``single_writer``, which logs a warning instead. Four requests."""
    key = f"{_PROBE}{uuid.uuid4().hex}"
    first, second = b"conditional-create probe: first", b"conditional-create probe: second"
    try:
        created = storage.put_if_absent(key, first)
        refused = not storage.put_if_absent(key, second)
        kept = bytes(storage.get(key)) == first
    finally:
        storage.delete(key)
    if created and refused and kept:
        return
    problem = (
        f"{storage.url} does not honour conditional creates (a create of the existing key "
        f"{key} {'was accepted' if not refused else 'changed it'}): trainsnap cannot fence a "
        "superseded writer there, so two jobs writing this root at once could both commit."
    )
    if single_writer:
        log.warning("%s Accepted because single_writer=True.", problem)
        return
    raise InvalidArgumentError(
        f"{problem} Use a store that supports conditional writes (on S3: PUT with "
        "If-None-Match: *), or, if no two jobs will ever write this root at once, accept the "
        "risk with ManagerOptions(single_writer=True).",
        path=storage.url,
        key=key,
    )


# -- the restart log ------------------------------------------------------------------------------


def record(storage: Storage, generation: int, kind: str, **fields: Any) -> None:
    """Append one event (an object of its own: object stores cannot append)."""
    now = time.time()
    key = f"events/{int(now * 1e6):020d}-{generation:012d}-{kind}.json"
    body = {"time": now, "generation": generation, "kind": kind, **fields}
    try:
        storage.put(key, json.dumps(body, default=str).encode())
    except OSError as e:  # the log is advisory: never fail training for it
        log.warning("could not record %s event in %s: %s", kind, storage.url, e)


_PROGRESS = "progress/gen-"


def record_start(storage: Storage, generation: int, **fields: Any) -> float | None:
    """(coordinator, once the root is taken) The run's ``start`` event (with ``fields``),
    after a ``crash_detected`` one when the previous generation ended without closing; returns
    the mean time between failures the log shows (None: too few). Reads the event log twice."""
    crashed = last_generation_crashed(events(storage), generation, storage=storage)
    if crashed is not None:
        record(
            storage,
            generation,
            "crash_detected",
            previous_generation=crashed["generation"],
            last_event=crashed["kind"],
            last_time=crashed["time"],
        )
        log.warning(
            "the previous job on %s (generation %s) ended without closing: crash after its "
            "%r event",
            storage.url,
            crashed["generation"],
            crashed["kind"],
        )
    record(storage, generation, "start", **fields)
    return observed_mtbf(events(storage))[0]


def record_progress(storage: Storage, generation: int, step: int) -> None:
    """Overwrite this generation's progress record: the last step it completed, and when. One
    small object per generation (not per step), so a crashed run's reach is known to within
    the manager's ``progress_seconds``."""
    body = json.dumps({"step": step, "time": time.time(), "generation": generation}).encode()
    try:
        storage.put(f"{_PROGRESS}{generation:012d}.json", body)
    except OSError as e:  # advisory, as the log is
        log.warning("could not record progress in %s: %s", storage.url, e)


def progress(storage: Storage) -> dict[int, dict[str, Any]]:
    """Every generation's progress record, by generation: ``step`` (an int) and ``time`` (a
    finite number of seconds). A malformed record is skipped with a warning naming it."""
    out: dict[int, dict[str, Any]] = {}
    for key in storage.list("progress/"):
        generation = _generation_of(key[len(_PROGRESS) :].removesuffix(".json"))
        if not key.startswith(_PROGRESS) or generation is None:
            _skip(storage, key, "not named progress/gen-<generation>.json")
            continue
        doc = read_advisory(storage, key)
        if doc is None:
            continue
        if _number(doc.get("time")) is None or not _is_int(doc.get("step")):
            _skip(storage, key, "no integer step and time in range")
            continue
        out[generation] = doc
    return out


def events(storage: Storage) -> list[dict[str, Any]]:
    """The restart log: every event, oldest key first. Each holds ``time`` (finite seconds
    since the epoch, at most :data:`MAX_TIME`), ``generation`` (a positive int) and ``kind`` (a
    str); a malformed one is skipped with a warning naming it. O(events), each read bounded."""
    out = []
    for key in sorted(storage.list("events/")):
        doc = read_advisory(storage, key)
        if doc is None:
            continue
        generation: Any = doc.get("generation")
        if (
            _number(doc.get("time")) is None
            or not (_is_int(generation) and 0 < generation <= MAX_GENERATION)
            or not isinstance(doc.get("kind"), str)
        ):
            _skip(storage, key, "not an event: needs a time, a generation and a kind")
            continue
        out.append(doc)
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> float | None:
    """``value`` as a time, if it is a finite number in [0, MAX_TIME]."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    seconds = float(value) if abs(value) < 2 * MAX_TIME else math.inf
    return seconds if 0 <= seconds <= MAX_TIME else None


def observed_mtbf(evs: list[dict[str, Any]]) -> tuple[float | None, int]:
    """(mean seconds between crashes, crashes) over the generations in the log."""
    by_gen: dict[int, list[dict[str, Any]]] = {}
    for e in evs:
        by_gen.setdefault(int(e.get("generation", 0)), []).append(e)
    uptime, crashes = 0.0, 0
    for g in sorted(by_gen):
        es = sorted(by_gen[g], key=lambda e: e["time"])
        uptime += es[-1]["time"] - es[0]["time"]
        if es[-1]["kind"] not in ("close", "preempt"):
            crashes += 1
    # The newest generation is the one running now: it has not crashed (yet).
    if by_gen and sorted(by_gen[max(by_gen)], key=lambda e: e["time"])[-1]["kind"] not in (
        "close",
        "preempt",
    ):
        crashes -= 1
    if crashes <= 0:
        return None, 0
    return uptime / crashes, crashes


def writer_alive(storage: Storage, generation: int) -> bool | None:
    """Whether the process that took ``generation`` still runs: known only on its own host
    (its lease entry names host and pid); None elsewhere or when the entry is unreadable."""
    owner = read_advisory(storage, f"{_GEN}{generation:012d}")
    if owner is None or owner.get("host") != socket.gethostname():
        return None
    pid = owner.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:
        return None
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    except OSError:
        return None
    return True


def last_generation_crashed(
    evs: list[dict[str, Any]], before: int, storage: Storage | None = None
) -> dict[str, Any] | None:
    """The last event of the newest generation older than ``before``, if it ended in a crash.

    With ``storage``, a previous writer that still runs on this host is not a crash: a second
    job took the root over from a live one (which can no longer commit). That is logged and
    recorded as a ``takeover`` event of ``before``, and None is returned. (On another host
    liveness is unknown at start; ``trainsnap history`` shows such a writer as superseded once
    it is seen writing after the takeover.)"""
    older = [e for e in evs if int(e.get("generation", 0)) < before]
    if not older:
        return None
    g = max(int(e["generation"]) for e in older)
    last = max((e for e in older if int(e["generation"]) == g), key=lambda e: e["time"])
    if last["kind"] in ("close", "preempt"):
        return None
    if storage is not None and writer_alive(storage, g):
        log.warning(
            "writer generation %d still runs on this host: generation %d takes %s over from a "
            "live job, which can no longer commit (stop one of them)",
            g,
            before,
            storage.url,
        )
        record(storage, before, "takeover", previous_generation=g)
        return None
    return last
