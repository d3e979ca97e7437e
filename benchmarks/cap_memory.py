"""Peak memory of the readers on a root whose files are each at their size cap.

One snapshot whose manifest is as large as a reader accepts (``encoding.MAX_MANIFEST``): one
int8 tensor stored as one chunk per byte, so the chunk table fills the manifest while the
snapshot stays valid and readable; its marker padded to ``MAX_MARKER_BYTES``. Then ``ts.read``,
``trainsnap verify`` and ``trainsnap gc --dry-run`` each run in a fresh process and report their
peak RSS (``ru_maxrss`` of the child) and seconds.

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

CHUNK_ROW = 24
"""Bytes one chunk takes in the manifest (object, offset, length: three int64)."""


def build(root: Path, nchunks: int) -> str:
    """A root with one committed snapshot whose tensor of ``nchunks`` int8 elements is stored
    one byte per chunk; its marker padded to the marker cap."""
    import torch

    import trainsnap as ts
    from trainsnap.format.manifest import marker_key
    from trainsnap.format.marker import MAX_MARKER_BYTES
    from trainsnap.protocol import commit
    from trainsnap.storage import open_storage

    data = torch.arange(nchunks, dtype=torch.int64).remainder(127).to(torch.int8)
    sid = ts.save({"w": data}, root, step=1).id
    storage = open_storage(root)
    manifest = commit.open_snapshot(storage, sid)
    n = manifest.chunk_length.sum()
    assert int(n) == nchunks and len(manifest.chunk_object) >= 1
    objects, offsets = [], []
    for row in range(len(manifest.chunk_object)):
        start, length = int(manifest.chunk_offset[row]), int(manifest.chunk_length[row])
        objects.append(np.full(length, manifest.chunk_object[row], np.int64))
        offsets.append(np.arange(start, start + length, dtype=np.int64))
    manifest.chunk_object = np.concatenate(objects)
    manifest.chunk_offset = np.concatenate(offsets)
    manifest.chunk_length = np.ones(nchunks, np.int64)
    manifest.shard_nchunks = np.array([nchunks], np.int64)
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
    nchunks = (MAX_MANIFEST - (1 << 20)) // CHUNK_ROW
    nchunks = int(nchunks * (0.001 if args.smoke else args.fraction))
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        root = Path(scratch, "root")
        sid = build(root, nchunks)
        size = sum(p.stat().st_size for p in (root / "snapshots" / sid).iterdir())
        print(f"snapshot {sid}: manifest and marker {size / 2**20:.1f} MiB, {nchunks} chunks")
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
