"""The ``trainsnap`` command: list, inspect, verify, collect, compare, export and import the
snapshots of a root, and run the demo.

The command line is the only part of the package that prints (through
:mod:`~trainsnap.tools._console`). Output meant for people goes to stdout (tables, verdicts)
and stderr (progress, errors); ``show --json`` is for programs. Exit status: 0 when all is well,
1 when verification found problems, 2 for an error the user can fix (a
:class:`~trainsnap.TrainsnapError`: unknown snapshot, bad root...) or a usage error. ROOT and ID
arguments are resolved by :mod:`~trainsnap.tools._roots`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from trainsnap._version import __version__
from trainsnap.errors import IncompleteError, InvalidArgumentError, TrainsnapError
from trainsnap.tools import _roots
from trainsnap.tools._console import (
    byte_progress,
    growing_progress,
    reports_errors,
    say,
    stdout_console,
)
from trainsnap.tools._roots import existing_snapshot, open_root, resolve_snapshot

if TYPE_CHECKING:
    from trainsnap.api.verification import VerifyReport
    from trainsnap.storage import Storage

# Each command imports what it uses when it runs: --help and --version load no more than the
# command line itself, ls / show / interval / history no torch (only gc, export, import-dcp, diff
# and demo move tensors or read write reports, and need it).

app = typer.Typer(
    name="trainsnap",
    help="Crash-consistent, reshardable, verifiable snapshots of PyTorch training state.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,  # plain help: flags without a "<bool>" value, 80 columns
)

_ID_HELP = "A snapshot id, a step (55 or step-55), or 'latest'."

RootArg = Annotated[
    str,
    typer.Argument(
        metavar="ROOT", help="A directory, or a URL such as s3://bucket/prefix or memory://name."
    ),
]


# -- verification with a progress bar --------------------------------------------------------------


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
    with byte_progress(total, "verifying") as progress:
        report = verify_root(storage, snapshot_id, progress)
    return report, total


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
@reports_errors
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

    storage = open_root(root)
    bad: list[str] = []
    damaged: list[TrainsnapError] = []
    found = commit.list_committed(storage, damaged)
    infos = [SnapshotInfo.from_marker(c.marker, storage.url) for c in found]
    tiers: dict[str, list[str]] | None = None
    if local is not None:
        tiers = {c.snapshot_id: ["durable"] for c in found}
        for c in commit.list_committed(open_root(local)):
            if c.snapshot_id not in tiers:
                infos.append(SnapshotInfo.from_marker(c.marker, local))
            tiers.setdefault(c.snapshot_id, []).insert(0, "local")
        infos.sort(key=lambda i: (i.step, i.created, i.id))
    known = {c.snapshot_id for c in found} | {e.snapshot_id for e in damaged if e.snapshot_id}
    leftovers = _uncommitted(storage, known)
    out = stdout_console()
    if not infos:
        say(f"no committed snapshots in {root}")
    else:
        verdicts = {}
        if verify:
            report, _ = _verify(storage, None)
            verdicts = {s.id: "ok" if s.ok else "CORRUPT" for s in report.snapshots}
            bad = [s.id for s in report.snapshots if not s.ok]
        out.print(render.snapshot_table(infos, verdicts, tiers))
        total = sum(i.nbytes for i in infos)
        say(f"{len(infos)} committed snapshot(s), sizes summing to {render.human_size(total)}")
    if damaged:
        say(
            f"{len(damaged)} snapshot(s) with a damaged commit marker not listed; "
            f"`trainsnap verify {root}` says what is wrong"
        )
    if leftovers:
        say(
            f"{len(leftovers)} uncommitted snapshot(s) not listed (interrupted saves, never "
            "readable)"
        )
    if verify and (bad or damaged):
        say(
            f"verification found damage in {len(bad) + len(damaged)} snapshot(s); "
            f"`trainsnap verify {root}` says what is wrong",
            err=True,
        )
        raise typer.Exit(1)


# -- show -----------------------------------------------------------------------------------------


@app.command("show")
@reports_errors
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

    storage = open_root(root)
    m = commit.open_snapshot(storage, resolve_snapshot(storage, snapshot_id))
    if as_json:
        typer.echo(json.dumps(render.manifest_json(m), indent=2))
        return
    out = stdout_console()
    ob = render.owner_nbytes(m)
    out.print(render.header_grid(m))
    if m.tensor_keys:
        out.print(render.tensor_table(m, ob))
    if m.value_keys:
        out.print(render.value_table(m, ob))
    say(render.objects_line(m))


# -- verify ---------------------------------------------------------------------------------------


@app.command("verify")
@reports_errors
def verify_command(
    root: RootArg,
    snapshot_id: Annotated[
        str | None,
        typer.Argument(metavar="[ID]", help=_ID_HELP + " All when omitted."),
    ] = None,
) -> None:
    """Re-read every byte the snapshots reference and check it. Exit 1 if anything is wrong."""
    from trainsnap.tools import render

    storage = open_root(root)
    sid = None if snapshot_id is None else existing_snapshot(storage, snapshot_id)
    report, nbytes = _verify(storage, sid)
    out = stdout_console()
    for rep in report.snapshots:
        if rep.ok:
            say(f"{rep.id}: ok")
            continue
        out.print(
            Text(f"{rep.id}: {len(rep.problems)} problem(s)", style="red bold"), soft_wrap=True
        )
        for p in rep.problems:
            say(f"  - {p}")
    if report.uncommitted:
        say(
            f"{len(report.uncommitted)} uncommitted snapshot(s) skipped (interrupted saves, "
            "never readable)"
        )
    rate = nbytes / max(report.seconds, 1e-9) / 1e9
    say(
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
@reports_errors
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
    storage = open_root(root)
    writer = lease.active_writer(storage)
    report = collection.collect_root(storage, grace=seconds, dry_run=dry_run)
    verb = "would free" if dry_run else "freed"
    holder = f"writer generation {writer} holds the root" if writer else "no active writer"
    say(
        f"{verb} {render.human_size(report.bytes_freed)} in "
        f"{len(report.objects_deleted)} object(s); "
        f"{len(report.uncommitted_deleted)} uncommitted snapshot(s), "
        f"{report.temporaries_deleted} temporary file(s); kept {report.objects_kept} object(s) "
        f"of {report.snapshots_kept} snapshot(s) ({holder}"
        + (f", {report.young_skipped} within the grace period)" if writer else ")")
    )


@app.command("interval")
@reports_errors
def interval_command(
    cost: Annotated[str, typer.Option(help="Blocking cost of one save, e.g. 30s, 5m.")],
    mtbf: Annotated[str, typer.Option(help="Mean time between failures, e.g. 4h, 2d.")],
) -> None:
    """Young's and Daly's optimal checkpoint intervals."""
    from trainsnap.manager.policies import daly_interval, young_interval

    c, m = _duration("--cost", cost, positive=True), _duration("--mtbf", mtbf, positive=True)
    say(f"cost {c:g} s, MTBF {m:g} s")
    say(f"Young: {young_interval(c, m):.1f} s ({young_interval(c, m) / 60:.2f} min)")
    say(f"Daly:  {daly_interval(c, m):.1f} s ({daly_interval(c, m) / 60:.2f} min)")


@app.command("history")
@reports_errors
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

    storage = open_root(root)
    job = restarts.history(lease.events(storage), lease.progress(storage))
    if as_json:  # strict JSON: no NaN or infinity, whatever the log held
        typer.echo(json.dumps(job.as_dict(), indent=2, allow_nan=False))
    elif not job.runs:
        found = commit.list_committed(storage)
        say(
            f"{storage.url} has no restart log (snapshots saved without a CheckpointManager): "
            f"{len(found)} committed snapshot(s), newest step "
            + (str(found[-1].step) if found else "-")
        )
    else:
        stdout_console().print(render.history_table(job.runs))
        for line in render.HISTORY_NOTES:
            say(line)
        restored = render.restarts_table(job.runs)
        if restored is not None:
            stdout_console().print(restored)
            for line in render.RESTART_NOTES:
                say(line)
        for line in render.history_totals(job):
            say(line)
    if plot is not None and job.runs:
        say(f"plot: {render.history_chart(job, plot)}")


# -- export, import-dcp, diff --------------------------------------------------------------------


IdArg = Annotated[str, typer.Argument(metavar="ID", help=_ID_HELP)]


@app.command("export")
@reports_errors
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

    storage = open_root(root)
    m = commit.open_snapshot(storage, resolve_snapshot(storage, snapshot_id))
    plan = plan_export(
        m, dtype=parse_dtype(dtype), max_shard_size=parse_size(max_shard_size), prefix=prefix
    )
    with growing_progress("exporting") as progress:
        path = write_export(storage, m, plan, out, progress=progress)
    ntensors = sum(len(f.tensors) for f in plan.files)
    say(
        f"exported {ntensors} tensor(s), {render.human_size(plan.total_size)}, "
        f"of snapshot {m.snapshot_id} "
        f"to {path}" + (f" ({len(plan.files)} files)" if plan.sharded else "")
    )
    if plan.skipped:
        say(
            f"note: skipped {len(plan.skipped)} rank-scoped tensor(s) (each rank's own, no single "
            f"value): {', '.join(plan.skipped[:5])}" + (" ..." if len(plan.skipped) > 5 else "")
        )


@app.command("import-dcp")
@reports_errors
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
    from trainsnap.tools import render
    from trainsnap.tools.import_dcp import import_dcp

    storage = open_root(root, create=True)
    with growing_progress("importing") as progress:
        info = import_dcp(dcp_dir, storage, step=step, progress=progress, trust_pickle=trust_pickle)
    m = commit.open_snapshot(storage, info.id)
    say(
        f"imported {dcp_dir} as snapshot {info.id} (step {info.step}): "
        f"{len(m.tensor_keys)} tensor(s), {len(m.value_keys)} value(s), "
        f"{render.human_size(info.nbytes)}"
    )


@app.command("diff")
@reports_errors
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

    storage = open_root(root)
    ida, idb = resolve_snapshot(storage, first), resolve_snapshot(storage, second)
    with growing_progress("comparing") as progress:
        diffs = diff_snapshots(storage, ida, idb, progress=progress)
    shown = sorted((d for d in diffs if show_all or d.status != UNCHANGED), key=render.diff_order)
    if shown:
        stdout_console().print(render.diff_table(f"{ida} -> {idb}", shown))
    counts = diff_summary(diffs)
    parts = [f"{counts[s]} {s}" for s in (CHANGED, UNCHANGED, ADDED, REMOVED)]
    parts += [f"{counts[s]} {s}" for s in (RETYPED, RESHAPED) if counts[s]]
    unread = sum(1 for d in diffs if d.status == UNCHANGED and not d.read)
    say(
        f"{len(diffs)} tensor(s): "
        + ", ".join(parts)
        + (f"; {unread} unchanged known from shared objects without reading" if unread else "")
    )
    if not show_all and counts[UNCHANGED]:
        say(f"({counts[UNCHANGED]} unchanged tensor(s) not listed; --all lists them)")


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
    storage_option: Annotated[
        list[str] | None,
        typer.Option(
            "--storage-option",
            "-o",
            metavar="KEY=VALUE",
            help="An option for the store of every root the command opens, as storage_options= "
            "of the Python API (repeatable; VALUE is JSON when it parses, else a string), e.g. "
            "-o endpoint_url=http://127.0.0.1:9000 -o anon=true. Environment variables the "
            "store's library reads (AWS_ENDPOINT_URL, ...) apply too.",
        ),
    ] = None,
) -> None:
    """Crash-consistent, reshardable, verifiable snapshots of PyTorch training state."""
    try:
        _roots.set_storage_options(_roots.parse_storage_options(storage_option or ()))
    except InvalidArgumentError as e:
        raise typer.BadParameter(e.message, param_hint="--storage-option") from None


def main() -> None:
    """Console entry point (``trainsnap``)."""
    app()


if __name__ == "__main__":
    main()
