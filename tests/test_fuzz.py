"""Fuzzing every decoder of a file trainsnap reads, and the CLI commands that read them.

Each decoder is fed arbitrary bytes, real files with bytes flipped, cut or inserted, and real
documents with one field replaced by an arbitrary JSON value (hypothesis). For every input it must
return a value or raise a ``TrainsnapError`` kind (the CLI: exit 0, or 1 with its findings, or 2
with one ``error:`` line; never a traceback), within a time bound, and under an address-space
limit (``RLIMIT_AS``, set in the child process that runs the inputs): a decoder that allocated by
a number read from its input would die of ``MemoryError`` there. The CLI runs also check that
nothing beside the root changed.

The CI form tries :data:`CI_EXAMPLES` inputs per decoder, derandomized (the same inputs on every
run: no flakes), in one child process. The long form is one command::

    TRAINSNAP_FUZZ_EXAMPLES=20000 TRAINSNAP_FUZZ_SEED=1 pytest tests/test_fuzz.py -s

(random inputs from the seed; it prints how many inputs each decoder took and how long;
``TRAINSNAP_FUZZ_ONLY=dcp-metadata,tree`` limits a run to those decoders).

Besides mutated files, three generators aim at hostile inputs of their own kind: ``flood``
(sets, dicts, tree nodes and DCP pickles of integer and float keys crafted to share one hash),
``dcp-shared`` (pickles whose memo or ``DUP`` nests one record in itself up to 64 times, as a
set item, a dict key or a plain value), and ``lying-store`` (``list_snapshots`` and ``ts.read``
against :class:`trainsnap.testing.lying_s3.LyingS3` telling one of its lies, on every key or only
on markers or manifests; a fortieth of the inputs, each takes seconds).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import pytest

CI_EXAMPLES: Final = 120
"""Inputs per decoder in the CI form (a quarter of it for the CLI, which runs three commands
and a read per input)."""
EXAMPLES: Final = int(os.environ.get("TRAINSNAP_FUZZ_EXAMPLES", CI_EXAMPLES))
SEED: Final = os.environ.get("TRAINSNAP_FUZZ_SEED")
MEMORY_HEADROOM: Final = 1 << 30
"""Address space the child may add to what it holds once everything is imported."""
SECONDS_PER_INPUT: Final = 10.0
"""Most one input may take (generous: the machine is shared; a decoder driven by a number in
its input takes minutes)."""
pytestmark = pytest.mark.timeout(300 + EXAMPLES)  # the long form: about a second per input

DECODERS: Final = (
    "manifest",
    "manifest-fields",
    "marker",
    "values",
    "tree",
    "write-report",
    "dcp-metadata",
    "flood",
    "dcp-shared",
    "lying-store",
    "cli",
)
STORE_LIMITS: Final = {
    "TRAINSNAP_STORE_REQUEST_SECONDS": "1",
    "TRAINSNAP_STORE_RETRY_SECONDS": "2",
    "TRAINSNAP_STORE_WHOLE_READ": str(16 << 20),
    "TRAINSNAP_STORE_LIST_KEYS": "3000",
}
"""The object-store limits of the child (the lying-store inputs answer within seconds)."""


# -- the parent: one child runs every decoder ---------------------------------------------------


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch, "results.json")
        env = {**os.environ, "MALLOC_ARENA_MAX": "2", **STORE_LIMITS}
        cmd = [sys.executable, __file__, str(out), str(EXAMPLES), SEED or ""]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        found: dict[str, Any] = json.loads(out.read_text())
    print(f"\nfuzz: {EXAMPLES} inputs per decoder, seed {SEED or 'derandomized'}")
    for name, result in found.items():
        print(
            f"  {name:<15} {result['tried']:>7} inputs {result['seconds']:>8.1f} s  "
            f"slowest {result['slowest']:.2f} s  findings {len(result['findings'])}"
        )
    return found


@pytest.mark.parametrize("decoder", DECODERS)
def test_every_input_gives_a_value_or_a_trainsnap_error(
    results: dict[str, Any], decoder: str
) -> None:
    result = results[decoder]
    assert result["tried"] >= min(_examples_of(decoder, EXAMPLES), 20), result
    assert result["findings"] == [], result["findings"][:3]
    assert result["slowest"] < SECONDS_PER_INPUT


# -- the child ------------------------------------------------------------------------------------


class Finding(Exception):
    """An input a decoder answered with something other than a value or a TrainsnapError."""


def _bounded(call: Callable[[], Any], what: str) -> float:
    """Run ``call``; a raw exception (MemoryError under the limit included) is a finding."""
    import trainsnap as ts

    started = time.monotonic()
    try:
        call()
    except ts.TrainsnapError:
        pass
    except BaseException as e:
        raise Finding(f"{what}: {type(e).__name__}: {str(e)[:300]}") from e
    return time.monotonic() - started


def _samples(workdir: Path) -> dict[str, Any]:
    """Real files to mutate: a manifest and marker of a snapshot with a tree, values, sharded
    and compressed tensors; a write report; a DCP .metadata."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    import trainsnap as ts
    from trainsnap.format.manifest import marker_key
    from trainsnap.protocol import commit, write_reports
    from trainsnap.protocol.rank_save import WriteReport
    from trainsnap.storage import open_storage

    root = workdir / "root"
    state = {
        "model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3, dtype=torch.bfloat16)},
        "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "extra": {"when": (1, 2.5, None, b"x", {3: "y"}), "names": ["a", "b"]},
    }
    sid = ts.save(state, root, step=5).id
    storage = open_storage(root)
    marker = storage.get(marker_key(sid))
    manifest = storage.get(commit.committed_marker(storage, sid).manifest_key)
    report = WriteReport(bytes_new=10)
    report.objects.append(("ab" * 16, 100, b"\0" * 8, "raw", 100, (), b""))
    report.entries = [(0, -1, [(0, 0, 100)])]
    dcp_dir = workdir / "dcp"
    dcp.save(
        {"w": torch.ones(4, 3), "n": 3, "s": {"x": 1}}, checkpoint_id=str(dcp_dir), no_dist=True
    )
    metadata = (dcp_dir / ".metadata").read_bytes()
    pickle.loads(metadata)  # a real one (this process wrote it)
    return {
        "sid": sid,
        "manifest": manifest,
        "marker": marker,
        "report": write_reports.encode(report),
        "metadata": metadata,
        "values": [b'{"$tuple":[1,{"$float":"nan"},{"$bytes":"eA=="}]}', b'{"$dict":[[1,2]]}'],
    }


def _strategies() -> Any:
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.sampled_from([2**63 - 1, 2**62, -(2**63), 10**400 // 10**300, 2**40, -1]),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
        st.sampled_from(["$tuple", "$np", "<f4", "U99999999", "torch.strided", "raw"]),
    )
    json_values = st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=5),
            st.dictionaries(
                st.one_of(st.text(max_size=6), st.sampled_from(_TAG_NAMES)), inner, max_size=4
            ),
        ),
        max_leaves=20,
    )
    return st, json_values


_TAG_NAMES: Final = (
    "$tuple", "$float", "$bytes", "$dict", "$odict", "$size", "$dtype", "$set", "$frozenset",
    "$path", "$datetime", "$date", "$time", "$timedelta", "$np", "$npscalar", "d", "o", "l", "t",
)  # fmt: skip


def _mutated(st: Any, base: bytes) -> Any:
    """Bytes from ``base`` with a few flips, cuts, insertions or big numbers written in."""

    @st.composite
    def build(draw: Any) -> bytes:
        data = bytearray(base)
        for _ in range(draw(st.integers(1, 4))):
            kind = draw(st.sampled_from(["flip", "cut", "insert", "number"]))
            at = draw(st.integers(0, max(len(data) - 1, 0)))
            if kind == "flip" and data:
                data[at] ^= draw(st.integers(1, 255))
            elif kind == "cut":
                del data[at : at + draw(st.integers(1, 64))]
            elif kind == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=16))
            else:
                width = draw(st.sampled_from([1, 2, 4, 8]))
                number = draw(st.sampled_from([0, 1, 255, 2**31 - 1, 2**32 - 1, 2**62, 2**64 - 1]))
                data[at : at + width] = (number % 256**width).to_bytes(width, "little")
        return bytes(data)

    return st.one_of(build(), st.binary(max_size=256))


def _edit_field(doc: Any, path: list[int], value: Any) -> Any:
    """``doc`` with the node ``path`` picks (each step an index into the keys or items) set to
    ``value``."""
    if not path or not isinstance(doc, dict | list) or not doc:
        return value
    if isinstance(doc, dict):
        key = sorted(doc)[path[0] % len(doc)]
        return {**doc, key: _edit_field(doc[key], path[1:], value)}
    i = path[0] % len(doc)
    return [*doc[:i], _edit_field(doc[i], path[1:], value), *doc[i + 1 :]]


def _reseal(root: Path, sid: str, manifest: bytes, marker: bytes) -> None:
    """Write ``manifest`` and a marker whose size and digest match it."""
    from trainsnap.format.checksums import Hasher

    doc = json.loads(marker)
    doc["manifest"]["size"] = len(manifest)
    doc["manifest"]["digest"] = Hasher(doc["manifest"]["algorithm"]).digest(manifest).hex()
    (root / "snapshots" / sid / "manifest.bin").write_bytes(manifest)
    (root / "snapshots" / sid / "COMMITTED").write_text(json.dumps(doc))


def _cli_answer(args: list[str]) -> tuple[int, str, str]:
    from trainsnap.tools.cli import app

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            app(args=args, prog_name="trainsnap")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return code, out.getvalue(), err.getvalue()


def _fingerprint(home: Path, skip: Path) -> dict[str, tuple[int, int, int]]:
    prints = {}
    for directory, subdirectories, files in os.walk(home):
        for name in subdirectories + files:
            path = Path(directory, name)
            if path == skip or skip in path.parents:
                continue
            info = path.lstat()
            prints[str(path)] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return prints


def _targets(
    samples: dict[str, Any], workdir: Path
) -> dict[str, tuple[Any, Callable[[Any], None]]]:
    """Each decoder: (its input strategy, a call that checks one input)."""
    import shutil

    import trainsnap as ts
    from trainsnap.format import encoding, tree, values
    from trainsnap.format.marker import decode_marker
    from trainsnap.integrations.dcp_metadata import decode_metadata
    from trainsnap.protocol import write_reports

    st, json_values = _strategies()
    sid = samples["sid"]
    header, body = encoding.unpack(samples["manifest"])

    def manifest_fields(edit: tuple[list[int], Any]) -> None:
        doc = _edit_field(header, *edit)
        data = encoding.pack(doc if isinstance(doc, dict) else {"x": doc}, bytes(body))
        encoding.decode(data, snapshot_id=sid)

    def value(doc: Any) -> None:
        data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        values.decode(values.JSON, data, "k", allow_pickle=False, snapshot_id=sid)

    keys = ["a", "a.b", "0", "a.0.x", "c"]
    home = workdir / "cli"
    pristine = workdir / "root"
    outside = home / "outside"

    def cli(edit: tuple[int, bytes, bytes, list[int], Any]) -> None:
        which, mutated, marker, path, field = edit
        root = home / "root"
        if root.exists():
            shutil.rmtree(root)
        shutil.copytree(pristine, root, symlinks=True)
        manifest = samples["manifest"]
        if which == 0:
            manifest = mutated
        elif which == 1:
            doc = _edit_field(header, path, field)
            manifest = encoding.pack(doc if isinstance(doc, dict) else {"x": doc}, bytes(body))
        _reseal(root, sid, manifest, samples["marker"])
        if which == 2:
            (root / "snapshots" / sid / "COMMITTED").write_bytes(marker)
        before = _fingerprint(home, skip=root)
        for args in (
            ["verify", str(root)],
            ["show", str(root), sid],
            ["gc", str(root), "--dry-run"],
        ):
            code, out, err = _cli_answer(args)
            first, *rest = err.rstrip().splitlines() or [""]
            ok = (
                code == 0
                or (code == 1 and out.strip() != "")
                or (
                    code == 2
                    and first.startswith("error: ")
                    and all(r.startswith("  - ") for r in rest)
                )
            )
            if not ok or "Traceback" in out + err:
                raise Finding(f"{args[0]} exit {code}: {err[-300:]}")
        with contextlib.suppress(ts.TrainsnapError):
            ts.read(root, sid)
        if _fingerprint(home, skip=root) != before:
            raise Finding("a CLI command changed something beside the root")

    outside.mkdir(parents=True, exist_ok=True)
    (outside / "canary").write_text("untouched")
    tree_keys = st.sampled_from(["a", "b", "0", 0, 1.5, None])
    trees = st.recursive(
        st.just(0) | st.sampled_from([1, None, "x", []]),
        lambda inner: st.one_of(
            st.builds(
                lambda kind, pairs: {kind: pairs},
                st.sampled_from(["d", "o"]),
                st.lists(st.tuples(tree_keys, inner).map(list), max_size=4),
            ),
            st.builds(
                lambda kind, items: {kind: items},
                st.sampled_from(["l", "t"]),
                st.lists(inner, max_size=4),
            ),
        ),
        max_leaves=30,
    )
    edits = st.tuples(st.lists(st.integers(0, 50), max_size=6), json_values)
    store = _lying_store(workdir)
    return {
        "manifest": (
            _mutated(st, samples["manifest"]),
            lambda d: encoding.decode(d, snapshot_id=sid),
        ),
        "manifest-fields": (edits, manifest_fields),
        "marker": (_mutated(st, samples["marker"]), lambda d: decode_marker(d, sid)),
        "values": (st.one_of(json_values, *(_mutated(st, v) for v in samples["values"])), value),
        "tree": (trees, lambda t: tree.problems(t, set(keys))),
        "write-report": (_mutated(st, samples["report"]), write_reports.decode),
        "dcp-metadata": (_mutated(st, samples["metadata"]), decode_metadata),
        "flood": (_floods(st), _flood_check(sid)),
        "dcp-shared": (_shared_pickles(st), decode_metadata),
        "lying-store": (
            st.tuples(
                st.sampled_from(["oversized", "drip", "truncated", "endless", "storm", "bomb"]),
                st.sampled_from(["list", "read"]),
                st.sampled_from(["", "COMMITTED", "manifest"]),
            ),
            store,
        ),
        "cli": (
            st.tuples(
                st.integers(0, 2),
                _mutated(st, samples["manifest"]),
                _mutated(st, samples["marker"]),
                st.lists(st.integers(0, 50), max_size=6),
                json_values,
            ),
            cli,
        ),
    }


_P: Final = 2**61 - 1


def _floods(st: Any) -> Any:
    """(where, keys): keys of which many share one hash (multiples of 2**61 - 1, their
    negatives, floats of the same value, -1 and -2), in a container of ``where``'s kind."""
    key = st.one_of(
        st.integers(1, 10**6).map(lambda k: k * _P),
        st.integers(1, 10**6).map(lambda k: -k * _P),
        st.integers(1, 2**40).map(lambda k: float(k * _P)),
        st.sampled_from([-1, -2, 0, 0.0, _P, 2 * _P]),
        st.integers(-(2**70), 2**70),
    )
    return st.tuples(
        st.sampled_from(["$set", "$frozenset", "$dict", "tree", "dcp-set", "dcp-dict"]),
        st.lists(key, min_size=1, max_size=400),
        st.integers(0, 3000),
    )


def _flood_check(sid: str) -> Callable[[Any], None]:
    import pickle

    from trainsnap.format import tree, values
    from trainsnap.integrations.dcp_metadata import decode_metadata

    def check(case: tuple[str, list[Any], int]) -> None:
        where, drawn, extra = case
        keys = list(dict.fromkeys(drawn + [k * _P for k in range(1, extra + 1)]))
        if where == "tree":
            tree.problems({"d": [[k, 0] for k in keys]}, {tree.part(k) for k in keys})
        elif where.startswith("dcp"):
            out = bytearray(pickle.PROTO + b"\x04")
            out += pickle.EMPTY_SET if where == "dcp-set" else pickle.EMPTY_DICT
            out += pickle.MARK
            for k in keys:
                out += pickle.dumps(k, protocol=4)[2:-1] + (b"" if where == "dcp-set" else b"N")
            out += (pickle.ADDITEMS if where == "dcp-set" else pickle.SETITEMS) + pickle.STOP
            decode_metadata(bytes(out))
        else:
            body = keys if where != "$dict" else [[k, 0] for k in keys]
            data = json.dumps({where: body}).encode()
            values.decode(values.JSON, data, "k", allow_pickle=False, snapshot_id=sid)

    return check


def _shared_pickles(st: Any) -> Any:
    """Pickles in which each level references the one before twice (``DUP`` or ``MEMOIZE``
    and a memo ``GET``), up to 64 levels, used as a set item, a dict key or a value."""
    import pickle

    @st.composite
    def build(draw: Any) -> bytes:
        levels = draw(st.integers(1, 64))
        use = draw(st.sampled_from(["set", "key", "value", "list"]))
        leaf = draw(st.sampled_from([pickle.EMPTY_TUPLE, pickle.NONE, b"K\x07"]))
        out = bytearray(pickle.PROTO + b"\x04")
        out += {"set": pickle.EMPTY_SET, "key": pickle.EMPTY_DICT, "value": pickle.EMPTY_DICT}.get(
            use, pickle.EMPTY_LIST
        )
        out += pickle.MARK + (b"K\x01" if use == "value" else b"") + leaf
        for i in range(levels):
            if draw(st.booleans()):
                out += pickle.DUP + pickle.TUPLE2
            else:
                out += pickle.MEMOIZE + pickle.BINGET + bytes([i % 256]) + pickle.TUPLE2
        closing = {"set": pickle.ADDITEMS, "list": pickle.APPENDS}.get(use, pickle.SETITEMS)
        if use == "key":
            out += pickle.NONE
        return bytes(out + closing + pickle.STOP)

    return build()


def _lying_store(workdir: Path) -> Callable[[tuple[str, str, str]], None]:
    """One input against a lying S3 server holding two snapshots (started once, for the
    child's life): the lie, the call, and which keys the lie is told on."""
    import torch

    import trainsnap as ts
    from trainsnap.testing.lying_s3 import LyingS3

    server = LyingS3().__enter__()
    server.drip_seconds = 0.3
    url, options = server.url("fuzz"), server.options
    for step in (1, 2):
        ts.save(
            {"w": torch.ones(3) * step, "cfg": {"s": step}}, url, step=step, storage_options=options
        )

    def check(case: tuple[str, str, str]) -> None:
        lie, call, on = case
        server.lie, server.lie_on = lie, on
        try:
            if call == "list":
                ts.list_snapshots(url, storage_options=options)
            else:
                ts.read(url, storage_options=options)
        finally:
            server.lie = None

    return check


def _runner(
    check: Callable[[Any], None],
    name: str,
    tried: list[int],
    slowest: list[float],
    findings: list[str],
) -> Callable[[Any], None]:
    def run(value: Any) -> None:
        tried[0] += 1
        try:
            slowest[0] = max(slowest[0], _bounded(lambda: check(value), name))
        except Finding as e:
            findings.append(f"{e} <- input {str(value)[:200]}")

    return run


def _limit_memory() -> None:
    """The address space this process holds now, plus :data:`MEMORY_HEADROOM`."""
    with open("/proc/self/status") as status:
        held = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (held + MEMORY_HEADROOM, held + MEMORY_HEADROOM))


def _examples_of(name: str, examples: int) -> int:
    """Inputs for ``name``: fewer for the generators whose inputs cost seconds each."""
    if name == "cli":
        return max(examples // 4, 20)
    if name == "lying-store":
        return max(examples // 40, 3)
    return examples


def _child(out: str, examples: int, seed: str) -> None:
    import logging

    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    import trainsnap.tools.cli  # noqa: F401  (imported before the limit: imports are not inputs)

    logging.disable(logging.CRITICAL)
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)
        samples = _samples(workdir)
        targets = _targets(samples, workdir)
        _limit_memory()
        results = {}
        only = os.environ.get("TRAINSNAP_FUZZ_ONLY", "")
        for name in DECODERS:
            if only and name not in only.split(","):
                results[name] = {"tried": examples, "seconds": 0.0, "slowest": 0.0, "findings": []}
                continue
            strategy, check = targets[name]
            tried, slowest, findings = [0], [0.0], []
            run = _runner(check, name, tried, slowest, findings)
            configured = settings(
                max_examples=_examples_of(name, examples),
                database=None,
                deadline=None,
                derandomize=not seed,
                suppress_health_check=list(HealthCheck),
            )(given(strategy)(run))
            if seed:
                configured = hypothesis_seed(int(seed))(configured)
            started = time.monotonic()
            try:
                configured()
            except BaseException:
                findings.append(traceback.format_exc()[-1000:])
            results[name] = {
                "tried": tried[0],
                "seconds": time.monotonic() - started,
                "slowest": slowest[0],
                "findings": findings,
            }
        Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), sys.argv[3])
