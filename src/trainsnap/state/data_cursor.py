"""The data cursor of a :class:`~trainsnap.TrainState`: where the loop is in its data, saved
without touching it and restored without moving any global random stream.

Creating a ``DataLoader`` iterator draws its base seed (the seed of its worker processes) from
torch's global generator, unless the loader has its own ``generator=``. An uninterrupted run does
that when an epoch starts; a resumed run creates its first iterator at the restored step, after
the RNG was restored, and every dropout mask after it would be shifted by one draw. Each cursor
here makes that first iterator neutral:

* a torchdata ``StatefulDataLoader``: its resumed iterator is created while the state is being
  applied, before the RNG is restored (a :class:`~trainsnap.TrainState` restores the RNG last),
  and the loop's next ``iter(loader)`` is given that iterator. The loader's own generators
  (``generator=``, the sampler's) are saved and put back after it, so the next epoch's order and
  seeds are the uninterrupted run's (torchdata alone loses them without workers);
* a ``DataLoader`` over a :class:`~trainsnap.ElasticSampler` (or the sampler alone): the sampler
  takes back the one draw of the first iterator after a restore (see
  :meth:`~trainsnap.ElasticSampler.rewind_after_restore`);
* anything else with ``state_dict``/``load_state_dict`` is taken at its word.

A plain ``DataLoader`` over a ``RandomSampler`` or ``SequentialSampler`` keeps its position
nowhere: it is refused when the ``TrainState`` is built.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from trainsnap.errors import InvalidArgumentError
from trainsnap.state.sampler import ElasticSampler

_FINISHED = "_iterator_finished"
"""torchdata's key of a saved iterator that has ended."""
RESUMABLE = (
    "use torchdata's StatefulDataLoader (same arguments: from torchdata.stateful_dataloader "
    "import StatefulDataLoader), or DataLoader(dataset, batch_size=..., sampler=ts.ElasticSampler("
    "len(dataset), global_batch_size=..., seed=...)) and call sampler.step() after each batch"
)


class DataCursor:
    """A data cursor taken at its word: ``state_dict`` / ``load_state_dict`` of the object."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def state_dict(self) -> Any:
        return self.source.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.source.load_state_dict(state)

    def after_restore(self) -> None:
        """Called once the whole state, RNG included, is restored."""

    def elastic(self) -> ElasticSampler | None:
        return None


class ElasticCursor(DataCursor):
    """An :class:`~trainsnap.ElasticSampler`, alone or under its ``DataLoader``."""

    def __init__(self, sampler: ElasticSampler, loader: Any = None) -> None:
        super().__init__(sampler)
        self.sampler = sampler
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        state = self.sampler.state_dict()
        gen = self._loader_generator()
        if gen is not None:  # it seeds the loader's workers: the same seeds after a resume
            state["loader_generator"] = gen.get_state()
        return state

    def load_state_dict(self, state: Any) -> None:
        self.sampler.load_state_dict(state)
        gen = self._loader_generator()
        if gen is not None and "loader_generator" in state:
            gen.set_state(state["loader_generator"])

    def after_restore(self) -> None:
        gen = self._loader_generator()
        self.sampler.rewind_after_restore([None] if gen is None else [None, gen])

    def _loader_generator(self) -> torch.Generator | None:
        gen = getattr(self.loader, "generator", None)
        return gen if isinstance(gen, torch.Generator) and gen.device.type == "cpu" else None

    def elastic(self) -> ElasticSampler | None:
        return self.sampler


class StatefulLoaderCursor(DataCursor):
    """A torchdata ``StatefulDataLoader``: its own state, and its generators' states."""

    def state_dict(self) -> dict[str, Any]:
        loader = self.source
        if loader._iterator is None:
            # Its state_dict() would start an iterator (workers, a draw from the RNG) and keep
            # it for the next iter(): a save would change the run. Nothing started: nothing to
            # record but what a load gave it, if anything.
            state = loader.next_iter_state or {}
        else:
            with _rng_untouched():
                state = loader.state_dict()
        return {"loader": state, "generators": _generator_states(loader)}

    def load_state_dict(self, state: Any) -> None:
        loader = self.source
        loader.load_state_dict(_read_through(loader, state["loader"]))
        if state["loader"]:
            # Start the resumed iterator now, before the RNG is restored: the loop's next
            # iter(loader) is given this one and draws nothing.
            loader.state_dict()
        for gen, saved in zip(_generators(loader), state["generators"], strict=False):
            if saved is not None:
                gen.set_state(saved)


def _read_through(loader: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its iterator marked finished when it had yielded its whole epoch.

    A save after an epoch's last step finds the iterator at the end of its batches but not yet
    finished: that happens at the next ``next()``, which raises ``StopIteration``. The loop of
    the uninterrupted run then asks for a new iterator (the next ``for batch in loader``, or
    ``iter()`` after the ``StopIteration``), which starts the next epoch. Resumed unmarked,
    the first iterator would be the old epoch's, empty: a loop over epochs would spend one of
    them on it. Marked, torchdata's next ``iter()`` starts the next epoch, drawing its seed
    from the restored generator as the uninterrupted run did after the save. O(1)."""
    try:
        batches = len(loader)
    except TypeError:  # an iterable dataset of no known length: its state says when it ends
        return state
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, dict):  # worker processes: yielded = at the snapshot + since
        yielded = snapshot.get("_snapshot_step", 0) + state.get("_steps_since_snapshot", 0)
    else:
        yielded = state.get("_num_yielded", 0)
    if state and not state.get(_FINISHED, True) and yielded >= batches:
        return {**state, _FINISHED: True}
    return state


def cursor_of(dataloader: Any) -> DataCursor:
    """The cursor of what ``TrainState(dataloader=...)`` was given; raise
    :class:`~trainsnap.InvalidArgumentError` for a loader whose position no cursor can bring
    back (a plain ``DataLoader`` not over an :class:`~trainsnap.ElasticSampler`)."""
    if isinstance(dataloader, ElasticSampler):
        return ElasticCursor(dataloader)
    if _is_stateful_dataloader(dataloader):
        _check_sampler(dataloader)
        return StatefulLoaderCursor(dataloader)
    if isinstance(dataloader, torch.utils.data.DataLoader):
        sampler = _elastic_sampler(dataloader)
        if sampler is not None:
            return ElasticCursor(sampler, dataloader)
        if not hasattr(dataloader, "state_dict"):
            raise InvalidArgumentError(
                f"TrainState: dataloader= is a plain torch DataLoader over a "
                f"{type(dataloader.sampler).__name__}, which keeps neither its position nor its "
                "epoch's order: a resume could not continue its data where it stopped. To resume "
                f"it exactly, {RESUMABLE}. A loop that has no data order to restore passes no "
                "dataloader= and no_data_order=True"
            )
    if not (hasattr(dataloader, "state_dict") and hasattr(dataloader, "load_state_dict")):
        raise InvalidArgumentError(
            f"TrainState: dataloader= needs state_dict()/load_state_dict(); got "
            f"{type(dataloader).__name__}. To resume a torch DataLoader exactly, {RESUMABLE}"
        )
    return DataCursor(dataloader)


def _is_stateful_dataloader(obj: Any) -> bool:
    """A torchdata ``StatefulDataLoader`` whose state is torchdata's own (a subclass with its
    own ``state_dict``, e.g. torchtitan's per-rank one, is taken at its word)."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return False
    return (
        isinstance(obj, StatefulDataLoader)
        and type(obj).state_dict is StatefulDataLoader.state_dict
        and type(obj).load_state_dict is StatefulDataLoader.load_state_dict
    )


def _check_sampler(loader: Any) -> None:
    """A torch ``RandomSampler`` (not torchdata's) under a StatefulDataLoader draws each epoch's
    order from a generator whose state at the epoch's start is kept nowhere."""
    sampler = loader.sampler
    if isinstance(sampler, torch.utils.data.RandomSampler) and not hasattr(sampler, "state_dict"):
        raise InvalidArgumentError(
            "TrainState: the StatefulDataLoader's sampler is torch's RandomSampler, which keeps "
            "no record of an epoch's order, so a resume in the middle of an epoch would see "
            "another order. Pass shuffle=True instead of sampler=RandomSampler(...) (torchdata "
            "then uses its own stateful RandomSampler), or sampler=ts.ElasticSampler(...)"
        )


def _elastic_sampler(loader: Any) -> ElasticSampler | None:
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(sampler, ElasticSampler):
            return sampler
    return None


def _generators(loader: Any) -> list[torch.Generator]:
    """The loader's own generator and its sampler's (torchdata's RandomSampler has one), each
    once: with ``generator=`` they are the same object."""
    found: list[torch.Generator] = []
    for gen in (getattr(loader, "generator", None), getattr(loader.sampler, "generator", None)):
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def _generator_states(loader: Any) -> list[torch.Tensor]:
    return [gen.get_state() for gen in _generators(loader)]


@contextmanager
def _rng_untouched() -> Iterator[None]:
    """Put torch's global generators back as they were (a loader's ``state_dict`` may talk to
    its workers; nothing it does may move the training's random streams)."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
