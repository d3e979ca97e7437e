"""Incremental snapshots by content: unchanged chunks are referenced, not rewritten, and every
snapshot stands alone (deleting older ones never breaks a newer one)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainsnap as ts
from trainsnap.manager import collection
from trainsnap.protocol import commit
from trainsnap.storage import open_storage


class LoRALinear(nn.Module):
    def __init__(self, n: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(n, n)
        self.base.requires_grad_(False)  # frozen: never changes
        self.a = nn.Parameter(torch.randn(rank, n) * 0.01)
        self.b = nn.Parameter(torch.zeros(n, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(LoRALinear(1024, 2) for _ in range(4)))


def test_lora_snapshots_write_only_what_changed_and_each_stands_alone(tmp_path):
    model = _model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    state = ts.TrainState(model, opt, rng=False)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    written: list[tuple[int, int, int]] = []
    with ts.CheckpointManager(
        tmp_path,
        interval=ts.Every(steps=2),
        retention=ts.KeepLast(3),
        async_save=False,
        options=ts.ManagerOptions(gc_grace=0.0),
    ) as mgr:
        for step in range(1, 13):
            x = torch.randn(8, 1024)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if mgr.step(step, state):
                assert mgr.last_save_bytes is not None
                written.append((step, *mgr.last_save_bytes))
                expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
    frozen = sum(p.numel() * 4 for n, p in model.named_parameters() if "base" in n)
    total = written[0][1]
    assert frozen / total > 0.98, "the scenario: 98% of the state's bytes frozen"
    for step, referenced, new in written[1:]:
        assert new <= 0.05 * referenced, f"step {step} wrote {new} of {referenced} bytes"
    print("LoRA snapshots (step, referenced, written):", written, f"frozen {frozen / total:.3f}")
    assert written[0][2] == written[0][1]  # the first writes everything
    # Every retained snapshot loads bitwise; deleting older ones never breaks a newer one.
    storage = open_storage(tmp_path)
    retained = [s for s in ts.list_snapshots(tmp_path)]
    assert [s.step for s in retained] == [8, 10, 12]
    for i, snap in enumerate(retained):
        for older in retained[:i]:
            commit.delete_snapshot(storage, older.id)
        collection.collect(storage, grace=None)
        m2 = _model()
        dst = {"model": m2.state_dict()}
        ts.load(dst, tmp_path, snapshot=snap.id)
        for k, v in expected[snap.step].items():
            assert torch.equal(dst["model"][k], v), (snap.step, k)
        assert ts.verify(tmp_path, snap.id).ok
        referenced = set(commit.open_snapshot(storage, snap.id).object_names)
        on_disk = {p.name for p in (tmp_path / "objects").rglob("*") if p.is_file()}
        assert referenced <= on_disk


def test_retained_history_keeps_optimizer_state_at_reduced_precision(tmp_path):
    torch.manual_seed(1)
    model = nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = ts.TrainState(model, opt, no_data_order=True)
    moments: dict[int, torch.Tensor] = {}
    with ts.CheckpointManager(
        tmp_path,
        interval=ts.Every(steps=1),
        retention=[ts.KeepLast(1), ts.KeepEvery(2)],
        async_save=False,
        options=ts.ManagerOptions(quantize_history=True),
    ) as mgr:
        for step in range(1, 6):
            model(torch.randn(8, 256)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mgr.step(step, state)
            moments[step] = opt.state[model.weight]["exp_avg_sq"].clone()
    snaps = {s.step: s for s in ts.list_snapshots(tmp_path)}
    assert sorted(snaps) == [2, 4, 5]
    newest = commit.open_snapshot(open_storage(tmp_path), snaps[5].id)
    assert not newest.meta.get("approximate") and newest.level == "strict"
    old = commit.open_snapshot(open_storage(tmp_path), snaps[2].id)
    assert old.meta["approximate"]["precision"] == "bfloat16" and old.level == "training"
    assert snaps[2].nbytes < snaps[5].nbytes  # rounded moments compress
    m2 = nn.Linear(256, 256)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    fresh = ts.TrainState(m2, o2, no_data_order=True)
    with pytest.raises(ts.IncompatibleError, match="reduced precision"):
        ts.load(fresh, tmp_path, snapshot=snaps[2].id)
    info = ts.load(fresh, tmp_path, snapshot=snaps[2].id, level="training")
    assert info.level == "training"
    got = o2.state[m2.weight]["exp_avg_sq"]
    assert torch.equal(got, moments[2].to(torch.bfloat16).to(torch.float32))
    assert not torch.equal(got, moments[2])  # it is an approximation, and says so
    m3 = nn.Linear(256, 256)
    assert ts.load(ts.TrainState(m3, torch.optim.AdamW(m3.parameters())), tmp_path).step == 5
    assert ts.verify(tmp_path).ok


def test_identical_chunks_in_one_save_are_written_once_and_counts_are_stored_bytes(
    tmp_path, caplog
):
    # Found by the incremental benchmark: concurrent writers of the same object each wrote it,
    # and compressed objects were counted at their decoded size.
    state = {f"z{i}": torch.zeros(1 << 18) for i in range(16)}  # 16 identical 1 MiB payloads
    ts.save(state, tmp_path / "a", step=1)
    line = [r.getMessage() for r in caplog.records if r.name == "trainsnap.protocol.save_protocol"][
        -1
    ]
    assert "bytes=1048576 written=1048576" in line, line
    files = [p for p in (tmp_path / "a" / "objects").rglob("*") if p.is_file()]
    assert len(files) == 1
    ts.save(
        {"w": torch.randn(1 << 20)},
        tmp_path / "c",
        step=1,
        options=ts.SaveOptions(compression="bytegroup+zstd"),
    )
    line = [r.getMessage() for r in caplog.records if r.name == "trainsnap.protocol.save_protocol"][
        -1
    ]
    referenced = int(line.split("bytes=")[1].split()[0])
    written = int(line.split("written=")[1].split()[0])
    assert written == referenced < 4 << 20
