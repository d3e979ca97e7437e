"""Shared fixtures. Multi-rank tests use the harness in ``trainsnap.testing``; the S3 server on
loopback lives in ``tests/s3_fixture.py``."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from trainsnap import faults, tunables

pytest_plugins = ["s3_fixture"]


@pytest.fixture(autouse=True)
def _fresh_process_state() -> Iterator[None]:
    """Each test starts with default tunables and no armed fault."""
    tunables.set_for_testing(None)
    faults.clear()
    yield
    tunables.set_for_testing(None)
    faults.clear()


@pytest.fixture
def small_blocks() -> tunables.Tunables:
    """Tiny blocks and chunks, so that small test tensors span many blocks, chunks and packs."""
    t = tunables.Tunables(
        block_size=256, chunk_size=4096, pack_threshold=1024, io_threads=4, read_budget=8192
    )
    tunables.set_for_testing(t)
    return t


@pytest.fixture(autouse=True)
def _log_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trainsnap")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The chaos suite's table: fault, trials, detected, outcome."""
    import chaos

    table = chaos.render()
    if table:
        terminalreporter.section("chaos: contract under injected faults")
        terminalreporter.write_line(table)
