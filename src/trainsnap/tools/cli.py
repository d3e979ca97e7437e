"""The ``trainsnap`` command: list, inspect, verify, collect, compare, export and import the
snapshots of a root, and run the demo.

This is the only module that prints. Output meant for people goes to stdout (tables, verdicts)
and stderr (progress, errors); ``show --json`` is for programs. Exit status: 0 when all is well,
1 when verification found problems, 2 for an error the user can fix (a
:class:`~trainsnap.TrainsnapError`: unknown snapshot, bad root...) or a usage error.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ParamSpec, TypeVar
from urllib.parse import urlparse

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from trainsnap._version import __version__
from trainsnap.errors import (
    IncompleteError,
    InvalidArgumentError,
    NotFoundError,
    TrainsnapError,
    listed,
)

if TYPE_CHECKING:
    from trainsnap.api.verification import Progress as ProgressCallback
    from trainsnap.api.verification import VerifyReport
    from trainsnap.storage import Storage

# Each command imports what it uses when it runs: --help and --version load no more than the
# command line itself, ls / show / interval / history no torch (only gc, export, import-dcp, diff
# and demo move tensors or read write reports, and need it).

P = ParamSpec("P")
R = TypeVar("R")

PIPE_WIDTH = 200
"""Columns for tables when stdout is not a terminal."""


app = typer.Typer(
    name="trainsnap",
    help="Crash-consistent, reshardable, verifiable snapshots of PyTorch training state.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

_ID_HELP = "A snapshot id, a step (55 or step-55), or 'latest'."

RootArg = Annotated[
    str,
    typer.Argument(
        metavar="ROOT", help="A directory, or a URL such as s3://bucket/prefix or memory://name."
    ),
]


# -- plumbing -------------------------------------------------------------------------------------


def _out() -> Console:
    """A console on the current stdout (looked up per command, so test runners can capture it).

    Piped into a file or a log, tables get room rather than the 80 columns rich assumes, so ids
    and keys stay whole on one line for grep. No highlighting: rich would colour numbers and
    paths at random, which helps nobody."""
    console = Console(highlight=False)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(highlight=False, width=PIPE_WIDTH)
    return console


def _say(line: str, *, err: bool = False) -> None:
    """A plain line, never re-wrapped: messages are long and must stay greppable."""
    typer.echo(line, err=err)


def _reports_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Expected failures are for the user to fix, so they get the message (which says what to do)
    and every problem it gathered, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except TrainsnapError as e:
            _say(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except OSError as e:  # the file system said no: a path to fix, not a bug to trace
            where = f": {e.filename}" if e.filename else ""
            _say(f"error: {e.strerror or e}{where}", err=True)
            raise typer.Exit(2) from None

    return wrapper


# -- progress -------------------------------------------------------------------------------------


def _stderr_bar(what: str) -> Progress:
    """A byte progress bar on stderr, gone once finished, drawn only on a terminal: piped,
    there is nothing to redraw, and rich would leave an empty line before the next message."""
    columns = (
        TextColumn(what),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    console = Console(stderr=True)
    return Progress(*columns, console=console, transient=True, disable=not console.is_terminal)


@contextmanager
def _progress(total: int, what: str) -> Iterator[ProgressCallback]:
    """A byte progress bar on stderr (the summary line says the rest)."""
    with _stderr_bar(what) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)
        bar.update(task, completed=total)


def _bytes_to_verify(storage: Storage, ids: Sequence[str]) -> int:
    """What verification will read: each object once however many snapshots share it (a
    snapshot whose manifest cannot be opened reads nothing)."""
    from trainsnap.protocol import commit

    sizes: dict[str, int] = {}
    for sid in ids:
        try:
            m = commit.open_snapshot(storage, sid)
        except TrainsnapError:
            continue
        sizes.update(zip(m.object_names, m.object_sizes.tolist(), strict=True))
    return sum(sizes.values())


def _verify(storage: Storage, snapshot_id: str | None) -> tuple[VerifyReport, int]:
    """Verify one snapshot or all, with a progress bar; the report and the bytes read."""
    from trainsnap.api.verification import verify_root
    from trainsnap.protocol import commit

    if snapshot_id is None:
        ids = [c.snapshot_id for c in commit.list_committed(storage)]
    else:
        ids = [snapshot_id]
    total = _bytes_to_verify(storage, ids)
    with _progress(total, "verifying") as progress:
        report = verify_root(storage, snapshot_id, progress)
    return report, total


def _existing(storage: Storage, snapshot_id: str) -> str:
    """The id ``snapshot_id`` names, refusing a malformed or absent one up front: verifying
    nothing is a usage error, while a snapshot that exists but is damaged is a finding."""
    from trainsnap.protocol import commit

    sid = _snapshot(storage, snapshot_id, committed_only=False)
    try:
        commit.committed_marker(storage, sid)
    except NotFoundError:
        raise
    except TrainsnapError:
        pass  # uncommitted or damaged: verification reports it as a problem
    return sid


# -- roots and snapshot names ---------------------------------------------------------------------

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


def _open_root(root: str, *, create: bool = False) -> Storage:
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
    return open_storage(root)


_STEP_RE = re.compile(r"(?:step-?)?(\d{1,18})")


def _snapshot(storage: Storage, name: str, *, committed_only: bool = True) -> str:
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


# -- ls -------------------------------------------------------------------------------------------


def _uncommitted(storage: Storage, known: set[str]) -> list[str]:
    """Snapshots with something stored but no commit marker: interrupted saves."""
    from trainsnap.protocol import commit

    out = []
    for sid in sorted(commit.snapshot_ids(storage) - known):
        try:
            commit.committed_marker(storage, sid)
        except IncompleteError:
            out.append(sid)
        except TrainsnapError:
            continue
    return out


@app.command("ls")
@_reports_errors
def ls_command(
    root: RootArg,
    verify: Annotated[
        bool, typer.Option("--verify", help="Re-read and check every snapshot listed.")
    ] = False,
    local: Annotated[
        str | None,
        typer.Option(help="A local tier in front of ROOT: list both and say which holds what."),
    ] = None,
) -> None:
    """List the committed snapshots of ROOT (and of a local tier), oldest step first. With
    --verify, exit 1 if any is damaged (as `verify` does)."""
    from trainsnap.protocol import commit
    from trainsnap.protocol.snapshot_info import SnapshotInfo
    from trainsnap.tools import render

    storage = _open_root(root)
    bad: list[str] = []
    damaged: list[TrainsnapError] = []
    found = commit.list_committed(storage, damaged)
    infos = [SnapshotInfo.from_marker(c.marker, storage.url) for c in found]
    tiers: dict[str, list[str]] | None = None
    if local is not None:
        tiers = {c.snapshot_id: ["durable"] for c in found}
        for c in commit.list_committed(_open_root(local)):
            if c.snapshot_id not in tiers:
                infos.append(SnapshotInfo.from_marker(c.marker, local))
            tiers.setdefault(c.snapshot_id, []).insert(0, "local")
        infos.sort(key=lambda i: (i.step, i.created, i.id))
    known = {c.snapshot_id for c in found} | {e.snapshot_id for e in damaged if e.snapshot_id}
    leftovers = _uncommitted(storage, known)
    out = _out()
    if not infos:
        _say(f"no committed snapshots in {root}")
    else:
        verdicts = {}
        if verify:
            report, _ = _verify(storage, None)
            verdicts = {s.id: "ok" if s.ok else "CORRUPT" for s in report.snapshots}
            bad = [s.id for s in report.snapshots if not s.ok]
        out.print(render.snapshot_table(infos, verdicts, tiers))
        total = sum(i.nbytes for i in infos)
        _say(f"{len(infos)} committed snapshot(s), sizes summing to {render.human_size(total)}")
    if damaged:
        _say(
            f"{len(damaged)} snapshot(s) with a damaged commit marker not listed; "
            f"`trainsnap verify {root}` says what is wrong"
        )
    if leftovers:
        _say(
            f"{len(leftovers)} uncommitted snapshot(s) not listed (interrupted saves, never "
            "readable)"
        )
    if verify and (bad or damaged):
        _say(
            f"verification found damage in {len(bad) + len(damaged)} snapshot(s); "
            f"`trainsnap verify {root}` says what is wrong",
            err=True,
        )
        raise typer.Exit(1)


# -- show -----------------------------------------------------------------------------------------


@app.command("show")
@_reports_errors
def show_command(
    root: RootArg,
    snapshot_id: Annotated[str, typer.Argument(metavar="ID", help=_ID_HELP)] = "latest",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print a JSON summary for programs instead.")
    ] = False,
) -> None:
    """Describe one snapshot: its header, tensors, values and objects."""
    from trainsnap.protocol import commit
    from trainsnap.tools import render

    storage = _open_root(root)
    m = commit.open_snapshot(storage, _snapshot(storage, snapshot_id))
    if as_json:
        typer.echo(json.dumps(render.manifest_json(m), indent=2))
        return
    out = _out()
    ob = render.owner_nbytes(m)
    out.print(render.header_grid(m))
    if m.tensor_keys:
        out.print(render.tensor_table(m, ob))
    if m.value_keys:
        out.print(render.value_table(m, ob))
    _say(render.objects_line(m))


# -- verify ---------------------------------------------------------------------------------------


@app.command("verify")
@_reports_errors
def verify_command(
    root: RootArg,
    snapshot_id: Annotated[
        str | None,
        typer.Argument(metavar="[ID]", help=_ID_HELP + " All when omitted."),
    ] = None,
) -> None:
    """Re-read every byte the snapshots reference and check it. Exit 1 if anything is wrong."""
    from trainsnap.tools import render

    storage = _open_root(root)
    sid = None if snapshot_id is None else _existing(storage, snapshot_id)
    report, nbytes = _verify(storage, sid)
    out = _out()
    for rep in report.snapshots:
        if rep.ok:
            _say(f"{rep.id}: ok")
            continue
        out.print(
            Text(f"{rep.id}: {len(rep.problems)} problem(s)", style="red bold"), soft_wrap=True
        )
        for p in rep.problems:
            _say(f"  - {p}")
    if report.uncommitted:
        _say(
            f"{len(report.uncommitted)} uncommitted snapshot(s) skipped (interrupted saves, "
            "never readable)"
        )
    rate = nbytes / max(report.seconds, 1e-9) / 1e9
    _say(
        f"verified {len(report.snapshots)} snapshot(s), {render.human_size(nbytes)} in "
        f"{report.seconds:.2f} s ({rate:.2f} GB/s): "
        + ("all ok" if report.ok else f"{len(report.problems)} problem(s)")
    )
    if not report.ok:
        raise typer.Exit(1)


# -- gc and interval ------------------------------------------------------------------------------


def _duration(option: str, text: str, *, positive: bool = False) -> float:
    """Seconds in the value ``text`` of ``option``, errors naming the option as typed."""
    from trainsnap.manager.policies import parse_duration

    try:
        seconds = parse_duration(text)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{option}: {e}") from None
    if positive and not seconds > 0:
        raise InvalidArgumentError(
            f"{option} {text!r} is not a positive duration; give one such as 30s, 5m, 4h or 2d"
        )
    return seconds


@app.command("gc")
@_reports_errors
def gc_command(
    root: RootArg,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Say what would be freed; delete nothing.")
    ] = False,
    grace: Annotated[
        str,
        typer.Option(
            help="While a writer holds the root, leave unreferenced objects younger than this."
        ),
    ] = "1h",
) -> None:
    """Delete objects no committed snapshot references, and leftovers of interrupted saves.

    When no writer holds the root (its last job closed), everything unreferenced goes at once;
    otherwise only what is older than the grace period (a save in flight may still need it).
    """
    from trainsnap.manager import collection, lease
    from trainsnap.tools import render

    seconds = _duration("--grace", grace)
    storage = _open_root(root)
    writer = lease.active_writer(storage)
    report = collection.collect_root(storage, grace=seconds, dry_run=dry_run)
    verb = "would free" if dry_run else "freed"
    holder = f"writer generation {writer} holds the root" if writer else "no active writer"
    _say(
        f"{verb} {render.human_size(report.bytes_freed)} in "
        f"{len(report.objects_deleted)} object(s); "
        f"{len(report.uncommitted_deleted)} uncommitted snapshot(s), "
        f"{report.temporaries_deleted} temporary file(s); kept {report.objects_kept} object(s) "
        f"of {report.snapshots_kept} snapshot(s) ({holder}"
        + (f", {report.young_skipped} within the grace period)" if writer else ")")
    )


@app.command("interval")
@_reports_errors
def interval_command(
    cost: Annotated[str, typer.Option(help="Blocking cost of one save, e.g. 30s, 5m.")],
    mtbf: Annotated[str, typer.Option(help="Mean time between failures, e.g. 4h, 2d.")],
) -> None:
    """Young's and Daly's optimal checkpoint intervals."""
    from trainsnap.manager.policies import daly_interval, young_interval

    c, m = _duration("--cost", cost, positive=True), _duration("--mtbf", mtbf, positive=True)
    _say(f"cost {c:g} s, MTBF {m:g} s")
    _say(f"Young: {young_interval(c, m):.1f} s ({young_interval(c, m) / 60:.2f} min)")
    _say(f"Daly:  {daly_interval(c, m):.1f} s ({daly_interval(c, m) / 60:.2f} min)")


@app.command("history")
@_reports_errors
def history_command(
    root: RootArg,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the runs and totals as JSON for programs.")
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(help="Also draw steps over wall time, crashes marked, as a PNG file."),
    ] = None,
) -> None:
    """Every run and restart of the job on ROOT: how far each run got, what each restart lost
    (steps and seconds), which tier it restored from (own or partner memory, local disk,
    durable), how long it was down (RTO), and the job's goodput and MTBF."""
    from trainsnap.manager import lease, restarts
    from trainsnap.protocol import commit
    from trainsnap.tools import render

    storage = _open_root(root)
    job = restarts.history(lease.events(storage), lease.progress(storage))
    if as_json:  # strict JSON: no NaN or infinity, whatever the log held
        typer.echo(json.dumps(job.as_dict(), indent=2, allow_nan=False))
    elif not job.runs:
        found = commit.list_committed(storage)
        _say(
            f"{storage.url} has no restart log (snapshots saved without a CheckpointManager): "
            f"{len(found)} committed snapshot(s), newest step "
            + (str(found[-1].step) if found else "-")
        )
    else:
        _out().print(render.history_table(job.runs))
        for line in render.HISTORY_NOTES:
            _say(line)
        restored = render.restarts_table(job.runs)
        if restored is not None:
            _out().print(restored)
            for line in render.RESTART_NOTES:
                _say(line)
        for line in render.history_totals(job):
            _say(line)
    if plot is not None and job.runs:
        _say(f"plot: {render.history_chart(job, plot)}")


# -- export, import-dcp, diff --------------------------------------------------------------------


@contextmanager
def _bar(what: str) -> Iterator[Callable[[int, int], None]]:
    """A byte progress bar on stderr for operations that learn their total as they go: each
    advance carries it (export and diff know it once planned, import once laid out)."""
    with _stderr_bar(what) as bar:
        task = bar.add_task(what, total=None)
        yield lambda n, total: bar.update(task, total=total, advance=n)


IdArg = Annotated[str, typer.Argument(metavar="ID", help=_ID_HELP)]


@app.command("export")
@_reports_errors
def export_command(
    root: RootArg,
    snapshot_id: IdArg,
    out: Annotated[
        Path, typer.Argument(metavar="OUT", help="Directory to write to (created if needed).")
    ],
    fmt: Annotated[str, typer.Option("--format", help="Output format: safetensors.")],
    dtype: Annotated[
        str | None, typer.Option(help="Convert floating tensors to bf16, fp16 or fp32.")
    ] = None,
    max_shard_size: Annotated[
        str, typer.Option(help="Largest file, e.g. 2GB, 500MB (powers of ten) or 1GiB.")
    ] = "5GB",
    prefix: Annotated[
        str,
        typer.Option(help="Export the tensors whose keys start with this, without it ('' = all)."),
    ] = "model.",
) -> None:
    """Export a snapshot's model weights as Hugging Face safetensors, streamed (bounded memory)."""
    from trainsnap.protocol import commit
    from trainsnap.tools import render

    if fmt.lower() != "safetensors":
        raise InvalidArgumentError(f"--format {fmt!r} is not supported; use --format safetensors")
    from trainsnap.tools.export import parse_dtype, parse_size, plan_export, write_export

    storage = _open_root(root)
    m = commit.open_snapshot(storage, _snapshot(storage, snapshot_id))
    plan = plan_export(
        m, dtype=parse_dtype(dtype), max_shard_size=parse_size(max_shard_size), prefix=prefix
    )
    with _bar("exporting") as progress:
        path = write_export(storage, m, plan, out, progress=progress)
    ntensors = sum(len(f.tensors) for f in plan.files)
    _say(
        f"exported {ntensors} tensor(s), {render.human_size(plan.total_size)}, "
        f"of snapshot {m.snapshot_id} "
        f"to {path}" + (f" ({len(plan.files)} files)" if plan.sharded else "")
    )
    if plan.skipped:
        _say(
            f"note: skipped {len(plan.skipped)} rank-scoped tensor(s) (each rank's own, no single "
            f"value): {', '.join(plan.skipped[:5])}" + (" ..." if len(plan.skipped) > 5 else "")
        )


@app.command("import-dcp")
@_reports_errors
def import_dcp_command(
    dcp_dir: Annotated[
        Path,
        typer.Argument(metavar="DCP_DIR", help="A directory written by torch's dcp.save."),
    ],
    root: RootArg,
    step: Annotated[int, typer.Option(min=0, help="The step the snapshot records.")] = 0,
    trust_pickle: Annotated[
        bool,
        typer.Option(
            "--trust-pickle",
            help="Unpickle DCP_DIR/.metadata without restriction. By default only torch's DCP "
            "metadata classes and plain builtins are built, so a crafted checkpoint cannot run "
            "code; use this only for a checkpoint you trust.",
        ),
    ] = False,
) -> None:
    """Import a torch.distributed.checkpoint directory as a committed snapshot of ROOT.

    The DCP metadata is a pickle: it is read with an allow-list (see --trust-pickle)."""
    from trainsnap.protocol import commit
    from trainsnap.storage import open_storage
    from trainsnap.tools import render
    from trainsnap.tools.import_dcp import import_dcp

    _open_root(root, create=True)
    with _bar("importing") as progress:
        info = import_dcp(dcp_dir, root, step=step, progress=progress, trust_pickle=trust_pickle)
    m = commit.open_snapshot(open_storage(root), info.id)
    _say(
        f"imported {dcp_dir} as snapshot {info.id} (step {info.step}): "
        f"{len(m.tensor_keys)} tensor(s), {len(m.value_keys)} value(s), "
        f"{render.human_size(info.nbytes)}"
    )


@app.command("diff")
@_reports_errors
def diff_command(
    root: RootArg,
    first: Annotated[str, typer.Argument(metavar="A", help="The older snapshot: " + _ID_HELP)],
    second: Annotated[str, typer.Argument(metavar="B", help="The newer snapshot: " + _ID_HELP)],
    show_all: Annotated[bool, typer.Option("--all", help="List unchanged tensors too.")] = False,
) -> None:
    """Which tensors changed from snapshot A to B, and by how much (streamed, in float64)."""
    from trainsnap.tools import render
    from trainsnap.tools.diff import (
        ADDED,
        CHANGED,
        REMOVED,
        RESHAPED,
        RETYPED,
        UNCHANGED,
        diff_snapshots,
    )
    from trainsnap.tools.diff import summary as diff_summary

    storage = _open_root(root)
    ida, idb = _snapshot(storage, first), _snapshot(storage, second)
    with _bar("comparing") as progress:
        diffs = diff_snapshots(storage, ida, idb, progress=progress)
    shown = sorted((d for d in diffs if show_all or d.status != UNCHANGED), key=render.diff_order)
    if shown:
        _out().print(render.diff_table(f"{ida} -> {idb}", shown))
    counts = diff_summary(diffs)
    parts = [f"{counts[s]} {s}" for s in (CHANGED, UNCHANGED, ADDED, REMOVED)]
    parts += [f"{counts[s]} {s}" for s in (RETYPED, RESHAPED) if counts[s]]
    unread = sum(1 for d in diffs if d.status == UNCHANGED and not d.read)
    _say(
        f"{len(diffs)} tensor(s): "
        + ", ".join(parts)
        + (f"; {unread} unchanged known from shared objects without reading" if unread else "")
    )
    if not show_all and counts[UNCHANGED]:
        _say(f"({counts[UNCHANGED]} unchanged tensor(s) not listed; --all lists them)")


# -- demo and entry point -------------------------------------------------------------------------


@app.command("demo")
def demo_command(
    root: Annotated[
        str | None,
        typer.Option(
            help="Where the run keeps its snapshots, the reference run's beside it in "
            "ROOT-reference (default: a temporary directory)."
        ),
    ] = None,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 60,
    plot: Annotated[
        str | None, typer.Option(help="Also draw the loss curves into this PNG file.")
    ] = None,
    keep: Annotated[
        bool,
        typer.Option(
            "--keep",
            help="Keep the temporary directory (worker logs; snapshots without --root), "
            "which is otherwise removed unless the demo fails.",
        ),
    ] = False,
) -> None:
    """Train on 4 processes (data x tensor parallel), crash one rank in the middle of a save,
    resume on 2 processes, and prove the run continued the same trajectory."""
    from trainsnap.tools.demo import run_demo

    code = run_demo(root, steps, plot, keep=keep)
    if code:
        raise typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"trainsnap {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Crash-consistent, reshardable, verifiable snapshots of PyTorch training state."""


def main() -> None:
    """Console entry point (``trainsnap``)."""
    app()


if __name__ == "__main__":
    main()
