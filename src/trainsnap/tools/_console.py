"""What the ``trainsnap`` command prints, and the exit status of an error.

Output meant for people goes to stdout (tables, verdicts) through :func:`stdout_console` and
:func:`say`, progress bars to stderr (:func:`byte_progress`, :func:`growing_progress`: drawn
only on a terminal). :func:`reports_errors` turns an error the user can fix (a
:class:`~trainsnap.TrainsnapError`, or what the file system refused) into its message on stderr
and exit status 2, never a traceback.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, ParamSpec, TypeVar

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

from trainsnap.errors import TrainsnapError

if TYPE_CHECKING:
    from trainsnap.api.verification import Progress as ProgressCallback

P = ParamSpec("P")
R = TypeVar("R")

PIPE_WIDTH = 200
"""Columns for tables when stdout is not a terminal."""

USAGE_ERROR = 2
"""The exit status of an error the user can fix (and of a usage error: typer's own)."""


def stdout_console() -> Console:
    """A console on the current stdout (looked up per command, so test runners can capture it).

    Piped into a file or a log, tables get room rather than the 80 columns rich assumes, so ids
    and keys stay whole on one line for grep. No highlighting: rich would colour numbers and
    paths at random, which helps nobody."""
    console = Console(highlight=False)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(highlight=False, width=PIPE_WIDTH)
    return console


def say(line: str, *, err: bool = False) -> None:
    """A plain line, never re-wrapped: messages are long and must stay greppable."""
    typer.echo(line, err=err)


def reports_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Expected failures are for the user to fix, so they get the message (which says what to do)
    and every problem it gathered, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except TrainsnapError as e:
            say(f"error: {e}", err=True)
            raise typer.Exit(USAGE_ERROR) from None
        except OSError as e:  # the file system said no: a path to fix, not a bug to trace
            where = f": {e.filename}" if e.filename else ""
            say(f"error: {e.strerror or e}{where}", err=True)
            raise typer.Exit(USAGE_ERROR) from None

    return wrapper


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
def byte_progress(total: int, what: str) -> Iterator[ProgressCallback]:
    """A byte progress bar on stderr (the summary line says the rest)."""
    with _stderr_bar(what) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)
        bar.update(task, completed=total)


@contextmanager
def growing_progress(what: str) -> Iterator[Callable[[int, int], None]]:
    """A byte progress bar on stderr for operations that learn their total as they go: each
    advance carries it (export and diff know it once planned, import once laid out)."""
    with _stderr_bar(what) as bar:
        task = bar.add_task(what, total=None)
        yield lambda n, total: bar.update(task, total=total, advance=n)
