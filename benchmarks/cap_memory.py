"""Peak memory of the readers on a root whose files are each at their size cap.

One snapshot whose manifest is as large as a reader accepts (``encoding.MAX_MANIFEST``): one
int8 tensor stored as flat shards of 8 bytes, so the shard and chunk tables fill the manifest
while the snapshot stays valid and readable; its marker padded to ``MAX_MARKER_BYTES``. Then
``ts.read``, ``trainsnap verify`` and ``trainsnap gc --dry-run`` each run in a fresh process and
report their peak RSS (``ru_maxrss`` of the child) and seconds.

    python -m benchmarks.cap_memory [--smoke] [--dir DIR]

``--smoke`` builds a manifest of a thousandth of the cap (what the smoke test runs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHARD_ROW = 56
"""Bytes one flat shard of one chunk takes in the manifest: kind, start, length, chunk count,
and its chunk (object, offset, length), each an int64."""
SHARD_BYTES = 8
"""Bytes of each shard: the rows, not the bytes, are what a reader's work grows with."""


def build(root: Path, nshards: int) -> str:
    """A root with one committed snapshot of one int8 tensor of ``nshards * SHARD_BYTES``
    elements saved as ``nshards`` flat shards of one chunk each; its marker padded to the
    marker cap."""
    import torch

    import trainsnap as ts
    from trainsnap.format.manifest import FLAT, marker_key
    from trainsnap.format.marker import MAX_MARKER_BYTES
    from trainsnap.protocol import commit
    from trainsnap.storage import open_storage

    numel = nshards * SHARD_BYTES
    data = torch.arange(numel, dtype=torch.int64).remainder(127).to(torch.int8)
    sid = ts.save({"w": data}, root, step=1).id
    storage = open_storage(root)
    manifest = commit.open_snapshot(storage, sid)
    objects, offsets = [], []
    for row in range(len(manifest.chunk_object)):
        start, length = int(manifest.chunk_offset[row]), int(manifest.chunk_length[row])
        assert length % SHARD_BYTES == 0
        objects.append(np.full(length // SHARD_BYTES, manifest.chunk_object[row], np.int64))
        offsets.append(np.arange(start, start + length, SHARD_BYTES, dtype=np.int64))
    manifest.chunk_object = np.concatenate(objects)
    manifest.chunk_offset = np.concatenate(offsets)
    manifest.chunk_length = np.full(nshards, SHARD_BYTES, np.int64)
    manifest.tensor_nshards = np.array([nshards], np.int64)
    manifest.shard_kind = np.full(nshards, FLAT, np.int64)
    geo = np.empty((nshards, 2), np.int64)
    geo[:, 0] = np.arange(0, numel, SHARD_BYTES)
    geo[:, 1] = SHARD_BYTES
    manifest.shard_geo = geo.reshape(-1)
    manifest.shard_nchunks = np.ones(nshards, np.int64)
    manifest._derived.clear()
    storage.delete(marker_key(sid))
    commit.write_commit(storage, manifest, writer={})
    marker = json.loads(storage.get(marker_key(sid)))
    pad = MAX_MARKER_BYTES - len(json.dumps(marker, separators=(",", ":"))) - 16
    marker["writer"] = {"pad": "x" * pad}
    storage.delete(marker_key(sid))
    storage.put(marker_key(sid), json.dumps(marker, separators=(",", ":")).encode())
    return sid


def main() -> None:
    from trainsnap.format.encoding import MAX_MANIFEST

    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--fraction", type=float, default=1.0, help="of the cap, e.g. 0.1")
    parser.add_argument("--tools", default="ts.read,verify,gc", help="which to run")
    args = parser.parse_args()
    nshards = (MAX_MANIFEST - (1 << 20)) // SHARD_ROW
    nshards = int(nshards * (0.001 if args.smoke else args.fraction))
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        root = Path(scratch, "root")
        sid = build(root, nshards)
        size = sum(p.stat().st_size for p in (root / "snapshots" / sid).iterdir())
        print(f"snapshot {sid}: manifest and marker {size / 2**20:.1f} MiB, {nshards} shards")
        python = [sys.executable, "-c"]
        tools = {
            "ts.read": [*python, f"import trainsnap as ts; ts.read({str(root)!r}, {sid!r})"],
            "verify": [sys.executable, "-m", "trainsnap.tools.cli", "verify", str(root)],
            "gc": [sys.executable, "-m", "trainsnap.tools.cli", "gc", str(root), "--dry-run"],
        }
        tools["(import)"] = [*python, "import trainsnap, trainsnap.tools.cli"]
        print(f"{'tool':<10}{'peak RSS MiB':>14}{'seconds':>10}{'exit':>6}")
        for name, command in tools.items():
            if name != "(import)" and name not in args.tools.split(","):
                continue
            # ru_maxrss of RUSAGE_CHILDREN is the largest child so far: run each in its own shell
            wrapped = [
                sys.executable,
                "-c",
                "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)",
                *command,
            ]
            started = time.monotonic()
            done = subprocess.run(wrapped, capture_output=True, text=True)
            seconds = time.monotonic() - started
            rss, code = done.stdout.strip().splitlines()[-1].split()
            print(f"{name:<10}{int(rss) / 1024:>14.0f}{seconds:>10.1f}{code:>6}")


if __name__ == "__main__":
    main()
