"""One way to pass storage options: ``storage_options=`` on every public function that opens a
root, ``--storage-option KEY=VALUE`` on every CLI command; and the CLI's help at 80 columns."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import trainsnap as ts
from s3_fixture import S3Root


def test_list_delete_and_verify_take_storage_options(s3_root: S3Root) -> None:
    """Why: ``list_snapshots`` and ``delete`` took the options as keywords (``storage_options=``
    failed deep in s3fs with a raw TypeError) and ``verify`` took none."""
    options = {"endpoint_url": s3_root.endpoint}
    info = ts.save({"w": torch.arange(4.0)}, s3_root.url, step=3, storage_options=options)
    listed = ts.list_snapshots(s3_root.url, storage_options=options)
    assert [s.id for s in listed] == [info.id]
    assert ts.verify(s3_root.url, storage_options=options).ok
    ts.delete(s3_root.url, info.id, storage_options=options)
    assert ts.list_snapshots(s3_root.url, storage_options=options) == []


def _cli(*args: str, columns: int = 200) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": str(columns)}
    cmd = [sys.executable, "-m", "trainsnap.tools.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_every_cli_command_takes_storage_options(s3_root: S3Root) -> None:
    """Why: the CLI had no way to pass a store option (an S3 endpoint only through
    AWS_ENDPOINT_URL)."""
    ts.save(
        {"w": torch.ones(4)},
        s3_root.url,
        step=7,
        storage_options={"endpoint_url": s3_root.endpoint},
    )
    option = f"endpoint_url={s3_root.endpoint}"
    for command in (["ls"], ["show"], ["verify"], ["history"]):
        out = _cli("--storage-option", option, *command[:1], s3_root.url, *command[1:])
        assert out.returncode == 0, (command, out.stderr[-2000:])
    out = _cli("-o", option, "ls", s3_root.url)
    assert "step-000000000007" in out.stdout or " 7 " in out.stdout, out.stdout
    bad = _cli("-o", "no-equals-sign", "ls", s3_root.url)
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr


def test_parse_storage_options_reads_json_values() -> None:
    from trainsnap.tools import _roots

    parsed = _roots.parse_storage_options(["anon=true", "n=3", "endpoint_url=http://h:1", "x={}"])
    assert parsed == {"anon": True, "n": 3, "endpoint_url": "http://h:1", "x": {}}
    with pytest.raises(ts.InvalidArgumentError):
        _roots.parse_storage_options(["=1"])


COMMANDS = ("ls", "show", "verify", "gc", "interval", "history", "export", "import-dcp", "diff")


def test_the_help_fits_80_columns_and_shows_flags_as_flags() -> None:
    """Why: the help showed ``--json <bool>`` although ``--json true`` is refused."""
    for command in ("", *COMMANDS):
        out = _cli(*filter(None, [command]), "--help", columns=80)
        assert out.returncode == 0, out.stderr
        assert "<bool>" not in out.stdout and "BOOLEAN" not in out.stdout, out.stdout
        too_wide = [line for line in out.stdout.splitlines() if len(line) > 80]
        assert not too_wide, (command, too_wide)
    assert "--storage-option KEY=VALUE" in _cli("--help", columns=80).stdout
