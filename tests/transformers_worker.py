"""A tiny ``transformers.Trainer`` run for the integration tests: a 2-layer GPT-2 built from a
config (no download), a shuffled in-memory dataset whose samples carry their ids, dropout on,
gradient accumulation 2. Each run reports the sample ids it trained on and every micro-batch's
loss as ``float.hex``, in order, so runs compare bit for bit."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

SAMPLES = 24
SEQ = 8


class Recorded(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.tokens = torch.randint(0, 64, (SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i], "sample_id": i}


class Collate:
    def __init__(self, seen: list[int]) -> None:
        self.seen = seen

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        self.seen.extend(int(item["sample_id"]) for item in items)
        return {
            "input_ids": torch.stack([item["input_ids"] for item in items]),
            "labels": torch.stack([item["labels"] for item in items]),
        }


def _model() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64,
        n_positions=SEQ,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.2,
        embd_pdrop=0.2,
        attn_pdrop=0.2,
    )
    return GPT2LMHeadModel(config)


def trainer_class(kind: str) -> type:
    """``Trainer`` (stock) or ``TrainsnapTrainer``, recording every micro-batch's loss and
    killing itself (SIGKILL) after optimizer step ``kill_at``."""
    from transformers import Trainer

    from trainsnap.integrations.transformers import TrainsnapTrainer

    base = Trainer if kind == "stock" else TrainsnapTrainer

    class Recording(base):  # type: ignore[misc,valid-type]
        losses: list[str]
        kill_at: int | None = None
        kill_in_save: str | None = None

        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            self.losses.append(float(loss).hex())
            return loss

        def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
            if self.kill_in_save is not None and self.state.global_step == self.kill_at:
                self.control.should_save = True
            super()._maybe_log_save_evaluate(*args, **kwargs)
            at_kill = self.kill_at is not None and self.state.global_step == self.kill_at
            if at_kill and self.kill_in_save is None:
                _wait_saves(self)
                os.kill(os.getpid(), signal.SIGKILL)

        def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
            super()._save_optimizer_and_scheduler(output_dir)
            if self.kill_in_save == "stock" and self.state.global_step == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # model and optimizer written, no state

    return Recording


def _wait_saves(trainer: Any) -> None:
    manager = getattr(trainer, "manager", None)
    if manager is not None:
        manager.wait()  # the snapshots up to here are committed: a kill now loses nothing


def train(
    rank: int,
    world: int,
    out: str,
    *,
    kind: str = "trainsnap",
    seedable: bool = True,
    kill_at: int | None = None,
    kill_in_save: str | None = None,
    resume: Any = None,
    per_device: int = 2,
    accumulation: int = 2,
    epochs: int = 3,
    save_steps: int = 2,
    extra_args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``train()``; returns the samples seen and losses (per process), the log history's
    losses, the restored snapshot's step and level, and the final weights."""
    from transformers import TrainingArguments, set_seed

    set_seed(0)
    model = _model()
    seen: list[int] = []
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=epochs,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        save_strategy="steps",
        save_steps=save_steps,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        remove_unused_columns=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        accelerator_config={"use_seedable_sampler": seedable},
        **(extra_args or {}),
    )
    cls = trainer_class(kind)
    trainer = cls(model=model, args=args, train_dataset=Recorded(), data_collator=Collate(seen))
    trainer.losses = []
    trainer.kill_at = kill_at
    trainer.kill_in_save = kill_in_save
    trainer.train(resume_from_checkpoint=resume)
    restored = getattr(trainer, "restored", None)
    return {
        "seen": seen,
        "losses": trainer.losses,
        "logged": [float(h["loss"]).hex() for h in trainer.state.log_history if "loss" in h],
        "steps": trainer.state.global_step,
        "restored": None if restored is None else (restored.step, restored.level),
        "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "best": trainer.state.best_model_checkpoint,
    }


def outputs(rank: int, world: int, out: str) -> dict[str, Any]:
    """The Trainer's outputs with snapshots: the best checkpoint (tracked, kept by retention,
    loaded at the end), ``save_model``, an export that ``from_pretrained`` loads; and what a
    resume refuses."""
    from transformers import GPT2LMHeadModel, TrainingArguments, set_seed

    import trainsnap as ts
    from trainsnap.integrations.transformers import TrainsnapTrainer, write_config
    from trainsnap.tools.export import export_safetensors

    set_seed(0)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="loss",
        load_best_model_at_end=True,
        save_total_limit=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    trainer = TrainsnapTrainer(
        model=_model(),
        args=args,
        train_dataset=Recorded(),
        eval_dataset=Recorded(),
        data_collator=Collate([]),
    )
    trainer.train()
    root = trainer.snapshot_root
    best = trainer.state.best_model_checkpoint
    best_id = os.path.basename(best)
    saved = ts.read(root, best_id, keys="model")["model"]
    live = trainer.model.state_dict()
    trainer.save_model(os.path.join(out, "final"))
    final = GPT2LMHeadModel.from_pretrained(os.path.join(out, "final")).state_dict()
    export = os.path.join(out, "export")
    export_safetensors(root, best_id, export)
    write_config(root, best_id, export)
    exported = GPT2LMHeadModel.from_pretrained(export).state_dict()
    refusals = {}
    for wanted, where in ((True, os.path.join(out, "empty")), (os.path.join(out, "final"), out)):
        args.output_dir = where
        try:
            trainer.train(resume_from_checkpoint=wanted)
        except ts.NotFoundError as e:
            refusals[str(wanted)] = str(e)
    return {
        "best": best,
        "best_step": trainer.state.best_global_step,
        "best_is_dir": os.path.isdir(best),
        "kept": [s.step for s in ts.list_snapshots(root)],
        "loaded_best": all(torch.equal(live[k], saved[k]) for k in saved),
        "saved_model": all(torch.equal(final[k], live[k]) for k in final),
        "exported": all(torch.equal(exported[k], saved[k]) for k in exported),
        "refusals": refusals,
    }
