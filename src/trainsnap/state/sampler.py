"""An elastic, resumable data cursor.

:class:`ElasticSampler` walks a seeded global order of the dataset (a permutation per epoch) and
counts its position in *global samples*. Each global batch of ``global_batch_size`` samples is
split into contiguous per-rank slices, so the sequence of global batches is the same for any
number of data-parallel ranks that divides the global batch: a run saved on 2 ranks and resumed
on 4 continues with exactly the next global samples, none repeated, none skipped.

The cursor advances when the training loop says a batch was consumed (:meth:`ElasticSampler.step`),
not when a loader prefetches, so worker prefetching never moves the resume point. Its state is
identical on every rank, hence stored once and valid on any topology.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from trainsnap.errors import InvalidArgumentError
from trainsnap.state.rng import derive_seed


class ElasticSampler(Sampler[int]):
    """Indices of this rank's share of each global batch, from a position in global samples.

    Args:
        dataset_len: number of samples in the dataset.
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        rank, world_size: this rank's data-parallel coordinates (default: the process group's).
        seed: seed of the global order.
        shuffle: permute the dataset each epoch (seeded by ``seed`` and the epoch) or not.

    Use it with a ``DataLoader(batch_size=global_batch_size // world_size, sampler=sampler)``
    and call :meth:`step` once per optimizer step. Samples of a last incomplete global batch of
    an epoch are dropped (every rank must take part in every step).
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        global_batch_size: int,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if rank is None or world_size is None:
            import torch.distributed as dist

            on = dist.is_available() and dist.is_initialized()
            rank = (dist.get_rank() if on else 0) if rank is None else rank
            world_size = (dist.get_world_size() if on else 1) if world_size is None else world_size
        if global_batch_size <= 0 or global_batch_size % world_size:
            raise InvalidArgumentError(
                f"global_batch_size {global_batch_size} must be a positive multiple of the "
                f"data-parallel size {world_size}"
            )
        if dataset_len < global_batch_size:
            raise InvalidArgumentError(
                f"dataset of {dataset_len} samples is smaller than one global batch "
                f"({global_batch_size})"
            )
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.consumed = 0
        """Global samples consumed since the start of training (all epochs)."""
        self._rewinds: list[tuple[torch.Generator | None, torch.Tensor]] = []

    @property
    def per_epoch(self) -> int:
        """Global samples used per epoch (whole global batches only)."""
        return self.dataset_len // self.global_batch_size * self.global_batch_size

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    def order(self, epoch: int) -> torch.Tensor:
        """The global order of epoch ``epoch``: sample ids, a function of (seed, epoch) only."""
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        g = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
        return torch.randperm(self.dataset_len, generator=g)

    def global_batch(self, index: int) -> list[int]:
        """Sample ids of global batch ``index`` (counted from the start of training)."""
        per = self.per_epoch // self.global_batch_size
        epoch, within = divmod(index, per)
        lo = within * self.global_batch_size
        return self.order(epoch)[lo : lo + self.global_batch_size].tolist()

    def __iter__(self) -> Iterator[int]:
        """This rank's samples from the current position to the end of the current epoch."""
        self._take_back_iterator_draw()
        start = self.consumed // self.global_batch_size
        per = self.per_epoch // self.global_batch_size
        epoch = start // per
        order = self.order(epoch)
        lo = self.rank * self.local_batch_size
        for b in range(start % per, per):
            base = b * self.global_batch_size + lo
            yield from order[base : base + self.local_batch_size].tolist()

    def __len__(self) -> int:
        per = self.per_epoch // self.global_batch_size
        left = per - (self.consumed // self.global_batch_size) % per
        return left * self.local_batch_size

    def rewind_after_restore(self, generators: list[torch.Generator | None]) -> None:
        """Arm the first iterator after a restore to leave ``generators`` (None: torch's global
        CPU generator) where they are now.

        A ``DataLoader`` draws one int64 from its ``generator=`` (or the global generator) when
        it creates an iterator, just before it asks this sampler for indices. Restored in the
        middle of an epoch, the uninterrupted run drew it when the epoch started, before the
        save; a resumed run draws it again at the restored step, which would shift every later
        draw (dropout). When this sampler is first iterated after such a restore, each
        generator that moved by exactly that one draw since now is put back. A generator that
        moved otherwise (the loop drew from it itself) is left alone. Restored at an epoch's
        boundary (after its last step), the uninterrupted run made that draw after the save,
        for the next epoch's iterator, as the resumed run does: nothing is taken back. O(1)."""
        if self.consumed % self.per_epoch == 0:
            self._rewinds = []
            return
        self._rewinds = [
            (gen, torch.get_rng_state() if gen is None else gen.get_state()) for gen in generators
        ]

    def _take_back_iterator_draw(self) -> None:
        rewinds, self._rewinds = self._rewinds, []
        for gen, before in rewinds:
            probe = torch.Generator()
            probe.set_state(before)
            torch.empty((), dtype=torch.int64).random_(generator=probe)
            now = torch.get_rng_state() if gen is None else gen.get_state()
            if torch.equal(now, probe.get_state()):
                if gen is None:
                    torch.set_rng_state(before)
                else:
                    gen.set_state(before)

    def step(self, batches: int = 1) -> None:
        """Record that ``batches`` global batches were consumed by the training loop."""
        self.consumed += batches * self.global_batch_size

    @property
    def epoch(self) -> int:
        return self.consumed // self.per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch_size": self.global_batch_size,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("seed", "shuffle", "dataset_len"):
            if state[k] != getattr(self, k):
                raise InvalidArgumentError(
                    f"ElasticSampler {k} is {getattr(self, k)!r} but the snapshot's cursor was "
                    f"saved with {state[k]!r}: the global order would differ. Use the saved value."
                )
        if state["global_batch_size"] != self.global_batch_size:
            raise InvalidArgumentError(
                f"ElasticSampler global_batch_size is {self.global_batch_size}, the snapshot was "
                f"saved with {state['global_batch_size']}: the run continues the same trajectory "
                "only with the same global batch (the number of ranks may change)."
            )
        self.consumed = int(state["consumed"])
