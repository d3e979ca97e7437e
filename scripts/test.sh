#!/bin/sh
# The project's test command: lint, format check, type check, then the test suite.
# Extra arguments go to pytest (e.g. `sh scripts/test.sh -m chaos`).
set -eu
cd "$(dirname "$0")/.."
sh scripts/venv.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/mypy
# pytest exits 5 when it collects nothing; any non-zero status fails the run.
exec .venv/bin/python -m pytest "$@"
