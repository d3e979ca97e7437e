#!/bin/sh
# The project's test command: lint, format check and type check once, then the whole suite on
# the oldest supported torch and a bounded subset on the newest (see "Supported versions" in the
# README). Both runs always happen; the command fails if either fails (pytest exits 5 when it
# collects nothing, which fails it too).
#
# Extra arguments go to pytest on the whole-suite run only, and the subset is then left out
# (e.g. `sh scripts/test.sh -k storage`); to run tests on the newest torch by hand:
# `.venv-next/bin/python -m pytest tests/test_resume.py`.
set -eu
cd "$(dirname "$0")/.."
TORCH_FULL=2.13.0    # the CPU wheel: the whole suite
TORCH_NEXT=2.14.1    # the newest release: the subset below
# Placements, resume, golden, async, DCP interop and the torchtitan integration: what leans on
# torch's distributed internals. Lightning's and accelerate's multi-process suites stay on the
# whole-suite run, for CI's time.
SUBSET="tests/test_placements.py tests/test_integration_torchtitan.py tests/test_resume.py
tests/test_golden.py tests/test_async.py tests/test_importdcp.py tests/test_checkpointable.py"

sh scripts/venv.sh .venv "$TORCH_FULL"
[ "$#" -gt 0 ] || sh scripts/venv.sh .venv-next "$TORCH_NEXT"
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/mypy

full=0
.venv/bin/python -m pytest "$@" || full=$?
if [ "$#" -gt 0 ]; then
    exit "$full"
fi
next=0
# shellcheck disable=SC2086  # SUBSET is a list of paths without spaces
.venv-next/bin/python -m pytest $SUBSET || next=$?
echo "test.sh: torch $TORCH_FULL whole suite: exit $full; torch $TORCH_NEXT subset: exit $next"
[ "$full" -eq 0 ] && [ "$next" -eq 0 ]
