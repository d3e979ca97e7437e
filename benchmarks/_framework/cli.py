"""The command line every benchmark shares: ``--reps``, ``--seed``, ``--dir``, ``--json`` and
``--smoke`` (tiny sizes: a check that the benchmark runs and verifies, not a measurement)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def parser(
    doc: str | None, *, reps: int | None = None, seed: bool = True
) -> argparse.ArgumentParser:
    """An argument parser described by the first paragraph of ``doc`` (the benchmark's
    docstring), with the shared options; ``reps`` is the default of ``--reps`` (None: none)."""
    description = (doc or "").split("\n\n")[0]
    result = argparse.ArgumentParser(description=description)
    if reps is not None:
        result.add_argument("--reps", type=int, default=reps, help=f"repetitions (default {reps})")
    if seed:
        result.add_argument("--seed", type=int, default=0, help="seed of the state's values")
    result.add_argument(
        "--dir", default=None, help="where to write (default: the system's temporary directory)"
    )
    result.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    result.add_argument(
        "--smoke", action="store_true", help="tiny sizes: check that it runs, measure nothing"
    )
    return result


def parse(
    arguments: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    smoke: Mapping[str, Any],
    validate: Callable[[argparse.Namespace], str | None] | None = None,
) -> argparse.Namespace:
    """Parse ``argv``; with ``--smoke``, the options in ``smoke`` default to those values (an
    option given explicitly still wins). Then ``--reps`` must be positive and ``validate``
    (returning an error message) must pass."""
    args = arguments.parse_args(argv)
    if args.smoke:
        arguments.set_defaults(**smoke)
        args = arguments.parse_args(argv)
    if getattr(args, "reps", 1) < 1:
        arguments.error("--reps must be at least 1")
    problem = validate(args) if validate is not None else None
    if problem:
        arguments.error(problem)
    return args
