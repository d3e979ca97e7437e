"""Two commits of trainsnap on one benchmark, alternating on the same machine.

A change that claims "no slower" is measured against the commit before it in the same hour, on
the same machine, with the runs interleaved, so that the machine's drift (other tenants, the
page cache, thermal state) falls on both alike. Each of ``--rounds`` rounds runs the benchmark
once on each commit, the order alternating from round to round (old-new, new-old, ...); each run
is a fresh process whose ``trainsnap`` comes from that commit's ``src/`` (checked out into a
temporary worktree) while the benchmark's code comes from this checkout, so both are measured
the same way (``--own-benchmarks``: each commit's own, where this checkout's benchmark uses
names the old commit lacks). Every number in the benchmark's ``--json`` output is collected;
reported per number are the median over the rounds on each commit and the ratio new / old.

    python -m benchmarks.compare a015336 HEAD -- manager_step --mib 64 --reps 1
    python -m benchmarks.compare a015336 WORKTREE --rounds 5 -- save_load --gib 0.25 --reps 1

``WORKTREE`` names this checkout as it is (uncommitted changes included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from benchmarks._framework.method import median
from benchmarks._framework.report import format_table

HERE = Path(__file__).resolve().parent.parent


def _numbers(value: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every number of a JSON document, by its path (``a.b.0.c``); booleans left out."""
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield prefix, float(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{prefix}.{i}" if prefix else str(i))


@contextmanager
def _checkout(revision: str) -> Iterator[Path]:
    """A directory holding ``revision``'s tree (``WORKTREE``: this checkout), removed after."""
    if revision == "WORKTREE":
        yield HERE
        return
    directory = Path(tempfile.mkdtemp(prefix="compare-"))
    git = ["git", "-C", str(HERE)]
    subprocess.run(
        [*git, "worktree", "add", "--detach", "--quiet", str(directory), revision], check=True
    )
    try:
        yield directory
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(directory)], check=False)


def _run(tree: Path, benchmark: list[str], out: Path, own: bool) -> dict[str, float]:
    """One run of the benchmark with ``tree``'s trainsnap (and, with ``own``, ``tree``'s
    benchmark code); its numbers."""
    code = tree if own else HERE
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "src"), str(code)]))
    command = [sys.executable, "-m", f"benchmarks.{benchmark[0]}", *benchmark[1:]]
    subprocess.run([*command, "--json", str(out)], check=True, env=env, cwd=code)
    return dict(_numbers(json.loads(out.read_text())))


def main(argv: list[str] | None = None) -> int:
    arguments = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arguments.add_argument("old", help="the commit measured as the reference")
    arguments.add_argument("new", help="the commit measured against it (WORKTREE: this checkout)")
    arguments.add_argument("--rounds", type=int, default=3, help="runs on each commit")
    arguments.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    arguments.add_argument(
        "--own-benchmarks",
        action="store_true",
        help="run each commit's own benchmark code (when this checkout's needs newer trainsnap)",
    )
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = arguments.parse_args(argv[:cut])
    benchmark = argv[cut + 1 :]
    if not benchmark or args.rounds < 1:
        arguments.error("give a benchmark after --, e.g. -- save_load --gib 0.25; --rounds >= 1")
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="compare-out-") as scratch:
        trees = {
            side: stack.enter_context(_checkout(rev))
            for side, rev in vars(args).items()
            if side in ("old", "new")
        }
        for round_ in range(args.rounds):
            order = ["old", "new"] if round_ % 2 == 0 else ["new", "old"]
            for side in order:
                print(
                    f"round {round_ + 1}/{args.rounds}: {side} ({getattr(args, side)})", flush=True
                )
                out = Path(scratch) / f"{side}-{round_}.json"
                runs[side].append(_run(trees[side], benchmark, out, args.own_benchmarks))
    keys = [key for key in runs["new"][0] if all(key in run for run in runs["old"] + runs["new"])]
    rows = []
    result: dict[str, Any] = {
        "old": args.old,
        "new": args.new,
        "rounds": args.rounds,
        "numbers": {},
    }
    for key in keys:
        old = median([run[key] for run in runs["old"]])
        new = median([run[key] for run in runs["new"]])
        ratio = new / old if old else float("nan")
        rows.append([key, old, new, ratio])
        result["numbers"][key] = {"old": old, "new": new, "new_over_old": ratio}
    print(f"{' '.join(benchmark)}: medians of {args.rounds} alternating runs each")
    print(format_table(["number", args.old, args.new, "new / old"], rows, digits=6))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
