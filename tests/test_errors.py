"""Error messages stay readable however many keys a state has: at most errors.MAX_LISTED items,
then a count and where to see them all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainsnap as ts
from trainsnap import errors


def test_a_shape_mismatch_on_a_300_layer_model_is_a_short_message(tmp_path: Path) -> None:
    """Why: a shape mismatch on a 300-layer model was a 601-line message."""
    saved = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(300)])
    ts.save({"model": saved.state_dict()}, tmp_path, step=1)
    other = torch.nn.Sequential(*[torch.nn.Linear(4, 5) for _ in range(300)])
    with pytest.raises(ts.IncompatibleError) as raised:
        ts.load({"model": other.state_dict()}, tmp_path)
    lines = str(raised.value).splitlines()
    assert len(raised.value.problems) == 600  # every one kept for programs
    assert len(lines) <= errors.MAX_LISTED + 2
    assert lines[-1].endswith("... and 580 more (600 in all; `trainsnap show ROOT ID` lists every "
                              "saved key with its shape)")  # fmt: skip


def test_bounded_lists_count_the_rest_and_say_where_to_see_them() -> None:
    assert errors.bounded(["a", "b"], limit=2) == ["a", "b"]
    assert errors.bounded(iter("abcde"), limit=2, see_all="`x` lists them") == [
        "a",
        "b",
        "... and 3 more (5 in all; `x` lists them)",
    ]
    assert errors.listed(map(str, range(30))).endswith("19, ... and 10 more (30 in all)")
    many = ts.CommitFailedError("failed", rank_errors={r: "boom" for r in range(1000)})
    assert len(str(many).splitlines()) == errors.MAX_LISTED + 2
    assert "(1000 in all; every one is in the error's `problems` attribute)" in str(many)
