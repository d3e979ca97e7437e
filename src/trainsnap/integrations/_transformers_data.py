"""The data position of a ``transformers.Trainer`` run as a cursor: where the epoch's order
comes from, and a resumed loader that starts at the position without walking the batches
before it.

The Trainer's loader (made by accelerate's ``prepare``) draws each epoch's order from its
sampler when the epoch's iterator starts: accelerate's ``SeedableRandomSampler`` from its seed
and its epoch counter; with ``use_seedable_sampler=False`` a ``RandomSampler`` from a generator
accelerate gives it (several processes) or from torch's global generator (one process). None of
these states is in the Trainer's own checkpoint. :class:`OrderRecorder` sits between the loader's
batch sampler and its sampler and records, each time an epoch starts, the state the order is
drawn from; :class:`DataPosition` saves it with the sampler's generator and epoch counter.

A resume then draws the epoch's order again from that state and starts at the position: for
torch's ``RandomSampler`` family (accelerate's seedable one included) and ``SequentialSampler``
the order is computed directly, O(dataset) in C and nothing per skipped sample in Python; any
other sampler is iterated from the recorded state past the position (indices only, no data).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler

from trainsnap.errors import IncompatibleError


class OrderRecorder(Sampler[int]):
    """The loader's sampler, unchanged, plus the state each epoch's order was drawn from.

    Attributes it does not have (``set_epoch``, ``epoch``, ``initial_seed``, ``generator``) are
    the wrapped sampler's, so accelerate and the Trainer reach it as before."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.epoch_start: torch.Tensor | None = None
        """The state of the generator the current epoch's order was drawn from."""
        self._seek: tuple[int, torch.Tensor | None] | None = None

    def __getattr__(self, name: str) -> Any:
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def __len__(self) -> int:
        return len(self.sampler)

    def seek(self, offset: int, epoch_start: torch.Tensor | None) -> None:
        """Make the next epoch's iterator start at sample ``offset`` of the order drawn from
        ``epoch_start`` (None: the generator as it is then)."""
        self._seek = (offset, epoch_start)

    def __iter__(self) -> Iterator[int]:
        seek, self._seek = self._seek, None
        gen = _order_generator(self.sampler)
        if seek is not None and seek[1] is not None:
            _set_state(gen, seek[1])
        self.epoch_start = _get_state(gen)
        if seek is None:
            yield from self.sampler
            return
        offset = seek[0]
        if _direct(self.sampler):
            yield from _order_from(self.sampler, offset)
        else:
            yield from itertools.islice(iter(self.sampler), offset, None)


def _order_generator(sampler: Any) -> torch.Generator | None:
    """The generator ``sampler`` draws its order from (None: torch's global one, or none)."""
    gen = getattr(sampler, "generator", None)
    return gen if isinstance(gen, torch.Generator) else None


def _get_state(gen: torch.Generator | None) -> torch.Tensor:
    return torch.get_rng_state() if gen is None else gen.get_state()


def _set_state(gen: torch.Generator | None, state: torch.Tensor) -> None:
    if gen is None:
        torch.set_rng_state(state)
    else:
        gen.set_state(state)


def _draws_from_generator(sampler: Any) -> bool:
    """Whether ``sampler`` takes a ``generator`` attribute and draws its order from it."""
    return isinstance(sampler, RandomSampler) and hasattr(sampler, "generator")


def _direct(sampler: Any) -> bool:
    """Whether the order of ``sampler`` can be computed here exactly as its ``__iter__``
    draws it: torch's own code, not a subclass that changes it (accelerate's seedable one
    only reseeds)."""
    from accelerate.data_loader import SeedableRandomSampler

    if type(sampler) is SequentialSampler:
        return True
    kinds = (RandomSampler, SeedableRandomSampler)
    return type(sampler) in kinds and not sampler.replacement


def _order_from(sampler: Any, offset: int) -> Iterator[int]:
    """``sampler``'s order from sample ``offset``, drawing what its ``__iter__`` draws (the
    same generator calls in the same order, so the generator ends where it would have)."""
    from accelerate.data_loader import SeedableRandomSampler

    n = len(sampler.data_source)
    if isinstance(sampler, SequentialSampler):
        yield from range(offset, n)
        return
    seedable = isinstance(sampler, SeedableRandomSampler)
    if seedable:
        if sampler.generator is None:
            sampler.generator = torch.Generator()
        sampler.generator.manual_seed(sampler.epoch + sampler.initial_seed)
    generator = sampler.generator
    if generator is None:  # RandomSampler: a seed from torch's global generator, as it does
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    left = offset
    for _ in range(sampler.num_samples // n):
        order = torch.randperm(n, generator=generator)
        if left < n:
            yield from order[left:].tolist()
        left = max(0, left - n)
    tail = torch.randperm(n, generator=generator)[: sampler.num_samples % n]
    yield from tail[left:].tolist()
    if seedable:
        sampler.set_epoch(sampler.epoch + 1)


def install(loader: Any) -> OrderRecorder | None:
    """Put an :class:`OrderRecorder` under the batch sampler of ``loader`` (accelerate's
    ``DataLoaderShard``); None where the loader has no such sampler (an iterable dataset, a
    batch sampler given as sampler)."""
    batch_sampler = _batches(loader)
    if batch_sampler is None:
        return None
    if isinstance(batch_sampler.sampler, OrderRecorder):
        return batch_sampler.sampler
    recorder = OrderRecorder(batch_sampler.sampler)
    batch_sampler.sampler = recorder
    return recorder


def _batches(loader: Any) -> BatchSampler | None:
    node = getattr(loader, "batch_sampler", None)
    if node is not None and not isinstance(node, BatchSampler):
        return None
    inner = getattr(node, "batch_sampler", None)  # accelerate's BatchSamplerShard
    node = inner if inner is not None else node
    if type(node) is not BatchSampler:
        return None
    return node


def samples_per_batch(loader: Any) -> tuple[int, bool]:
    """(samples of the sampler's order that one batch of this process stands for, whether a
    position in whole batches maps to that many samples exactly up to the epoch's end).

    With accelerate's ``BatchSamplerShard`` each process takes every ``processes``-th batch
    (or a slice of every batch with ``split_batches``); a last incomplete round is padded from
    the epoch's first batches, which a resumed iterator does not see: then it must walk from
    the start (``exact`` False)."""
    shard = loader.batch_sampler
    inner = _batches(loader)
    assert inner is not None
    size = inner.batch_size
    if shard is inner:
        return size, True
    per_round = size if shard.split_batches else size * shard.num_processes
    exact = inner.drop_last or len(inner.sampler) % per_round == 0  # type: ignore[arg-type]
    return per_round, exact


class DataPosition:
    """The cursor of a :class:`~trainsnap.TrainState` for the Trainer's loader: the epoch the
    Trainer is in, the state its order was drawn from, the sampler's generator and epoch
    counter. The same on every process (accelerate synchronises the generator), so it is stored
    once and follows the run onto another number of processes. The position inside the epoch
    is the Trainer's own (its global step, in ``TrainerState``)."""

    def __init__(self, recorder: OrderRecorder | None) -> None:
        self.recorder = recorder
        self.epoch = 0
        self.epoch_start: torch.Tensor | None = None
        """The restored epoch's order state, for :meth:`resume`."""

    def state_dict(self) -> dict[str, Any]:
        rec = self.recorder
        if rec is None:
            return {"epoch": self.epoch}
        gen = _order_generator(rec.sampler)
        return {
            "epoch": self.epoch,
            "epoch_start": rec.epoch_start,
            "generator": None if gen is None else gen.get_state(),
            "sampler_epoch": getattr(rec.sampler, "epoch", None),
            "seed": getattr(rec.sampler, "initial_seed", None),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        rec = self.recorder
        if rec is None:
            return
        if "generator" not in state:
            raise IncompatibleError(
                "the snapshot's data position has no sampler state and this Trainer's loader "
                "has one: resume with the dataset and sampler the snapshot was saved with",
                key="data",
            )
        self.epoch_start = state["epoch_start"]
        gen = _order_generator(rec.sampler)
        if gen is None and state["generator"] is not None and _draws_from_generator(rec.sampler):
            # Saved on several processes (accelerate gave the sampler a generator), resumed on
            # one (it gives none): the order continues from the saved generator.
            gen = rec.sampler.generator = torch.Generator()
        if gen is not None and state["generator"] is not None:
            gen.set_state(state["generator"])
        if state["sampler_epoch"] is not None and hasattr(rec.sampler, "epoch"):
            rec.sampler.epoch = int(state["sampler_epoch"])
        if state["seed"] is not None and hasattr(rec.sampler, "initial_seed"):
            rec.sampler.initial_seed = int(state["seed"])

    def resume(self, loader: Any, num_batches: int) -> bool:
        """Arm ``loader``'s next iterator to start ``num_batches`` batches into the restored
        epoch; False when it cannot start there directly (the caller skips batches instead,
        after :meth:`rewind`)."""
        if self.recorder is None:
            return False
        per_batch, exact = samples_per_batch(loader)
        if not exact:
            return False
        self.recorder.seek(num_batches * per_batch, self.epoch_start)
        return True

    def rewind(self) -> None:
        """Arm the next iterator to draw the restored epoch's order from its start."""
        if self.recorder is not None:
            self.recorder.seek(0, self.epoch_start)
