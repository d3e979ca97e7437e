#!/bin/sh
# Run the demo: builds .venv on first use, then `trainsnap demo` with any extra arguments.
set -eu
cd "$(dirname "$0")/.."
sh scripts/venv.sh
exec .venv/bin/trainsnap demo "$@"
