#!/bin/sh
# Create (or reuse) a virtual environment with trainsnap and its test dependencies.
#   sh scripts/venv.sh [DIR [TORCH_VERSION]]     (default: .venv with torch 2.13.0)
# DIR is relative to the repository root. torch is pinned first: a bare requirement would pull
# the newest build, which may be a multi-GB CUDA one. An environment whose torch differs from
# TORCH_VERSION (or lacks a test dependency) is brought up to date in place.
set -eu
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
TORCH="${2:-${TRAINSNAP_TORCH_VERSION:-2.13.0}}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "
import torch, trainsnap, zstandard, pytest, moto, s3fs, safetensors, torchdata, lightning, accelerate
import torchtitan.components.checkpointer
assert torch.__version__.split('+')[0] == '$TORCH', torch.__version__
" >/dev/null 2>&1; then
    echo "venv.sh: installing torch $TORCH and the test dependencies into $VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "torch==$TORCH"
    "$VENV/bin/python" -m pip install --quiet -e ".[s3,test]"
    # torchtitan's own requirements pull datasets, tensorboard and wandb; its checkpointer and
    # containers need only the pure-Python packages pinned in the test extra.
    "$VENV/bin/python" -m pip install --quiet --no-deps "torchtitan==0.3.0"
fi
