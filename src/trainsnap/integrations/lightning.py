"""Lightning's checkpoints as trainsnap snapshots: ``Trainer(plugins=[TrainsnapCheckpointIO()])``.

Lightning hands its checkpoint backend the whole checkpoint dict on global rank 0 (model state,
optimizer and scheduler states, loops, callbacks, hyper-parameters) and asks for it back by path
on every rank. :class:`TrainsnapCheckpointIO` saves the dict as a committed snapshot of a
trainsnap root (checksummed, content-addressed: an unchanged tensor is stored once however many
checkpoints hold it) and writes, at the ``.ckpt`` path Lightning chose, a small *pointer* to that
snapshot -- only after the commit, so a pointer never names an uncommitted snapshot. Paths and
roots may be local or any fsspec URL (``memory://``, ``s3://``): pointers and snapshots stay in
the store the path names. ``fit(ckpt_path="last")``, ``ModelCheckpoint`` top-k and
``save_last`` work unchanged; a removed top-k checkpoint deletes its snapshot and collects the
objects no other snapshot uses -- only in the plug-in's own root, whatever a pointer names.

The pointer file is a valid ``torch.save`` archive: ``torch.load`` of it does not return a
checkpoint but fails naming ``TrainsnapPointerFile`` (and, with ``weights_only=False``, says how
to load it); trainsnap reads the pointer from a JSON record of the archive without unpickling
(:mod:`~trainsnap.integrations._lightning_pointer` reads and writes it).
Lightning's own ``LightningModule.load_from_checkpoint`` reads files with ``torch.load``; use
this module's :func:`load_from_checkpoint` instead::

    trainer = lightning.Trainer(plugins=[TrainsnapCheckpointIO()], ...)  # root: <dir>/trainsnap
    model = load_from_checkpoint(MyModule, "checkpoints/last.ckpt")

Hyper-parameters that are not plain data (an ``argparse.Namespace``, a dataclass, a module such
as ``loss=nn.SmoothL1Loss()``) are refused, naming the key, unless pickled on opt-in with
``allow_pickle=("hyper_parameters",)``; trainsnap never unpickles anything else.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

from trainsnap.api.async_saver import AsyncSaver, SaveHandle
from trainsnap.api.options import SaveOptions
from trainsnap.api.snapshots import async_save, delete, load, read, save
from trainsnap.engine.pool import shut_down_idle_pools
from trainsnap.errors import IncompatibleError, InvalidArgumentError, NotFoundError
from trainsnap.format import tree
from trainsnap.format.values import PickleKeys, pickle_allowed
from trainsnap.integrations._lightning_pointer import (
    CheckpointNotFoundError,
    TrainsnapPointerFile,
    is_link,
    join_path,
    name_of,
    parent_of,
    path_exists,
    path_text,
    read_pointer,
    remove_path,
    same_root,
    write_pointer,
)
from trainsnap.manager import collection
from trainsnap.protocol import commit
from trainsnap.state.capture import is_stateful
from trainsnap.storage import Root, open_storage

try:
    from lightning.pytorch.plugins.io import CheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy as _ModelParallelStrategy
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "trainsnap.integrations.lightning needs Lightning: pip install 'trainsnap[lightning]'"
    ) from e

log = logging.getLogger(__name__)

DEFAULT_ROOT = "trainsnap"
"""The root's folder next to the checkpoints when no root is given."""
HPARAMS_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")
"""The checkpoint entries where Lightning puts the user's own objects."""


class TrainsnapCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that stores checkpoints as trainsnap snapshots.

    Args:
        root: the trainsnap root (a directory, ``s3://...``, ``memory://...``); default: a
            ``trainsnap`` folder in the directory of the first checkpoint path Lightning gives,
            in the same store.
        async_save: return once the checkpoint is staged (copied); writing and the commit go
            on in the background and the pointer is written by a done callback.
        allow_pickle: keys whose non-plain values may be pickled on save and unpickled on load
            (``("hyper_parameters",)``), or True for all; off by default.
        storage_options: options for the root's and the pointers' storage (``endpoint_url``...).

    The plug-in pickles (``strategy="ddp_spawn"``, ``torch.save(trainer)``) without its save in
    flight: a copy starts with none.

    Each checkpoint operation (save, load, remove, teardown) ends by letting the I/O threads it
    started exit (:func:`~trainsnap.engine.pool.shut_down_idle_pools`: a pool another save or
    load is using is left alone), so no trainsnap thread outlives a ``fit``, including the load
    and removal that ``ddp_spawn``'s main process does after the run's teardown. The next
    operation starts a fresh pool: a few thread starts per checkpoint.
    """

    def __init__(
        self,
        root: Root | None = None,
        *,
        async_save: bool = False,
        allow_pickle: PickleKeys = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.root = root
        self.async_save = async_save
        self.allow_pickle = allow_pickle
        self.storage_options = dict(storage_options or {})
        self._saver: AsyncSaver | None = None
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_saver=None, _lock=None, _errors=[])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- Lightning's interface ----------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` as a snapshot and point ``path`` at it once committed.
        ``storage_options`` (a dict) are merged over the plug-in's for this save."""
        self._raise_background_error()
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise InvalidArgumentError(
                "TrainsnapCheckpointIO.save_checkpoint: storage_options must be a dict of "
                f"storage options (endpoint_url...), got {type(storage_options).__name__}"
            )
        options = {**self.storage_options, **(storage_options or {})}
        pointer = path_text(path)
        root = self._root_for(pointer)
        step = int(checkpoint.get("global_step", 0))
        save_options = SaveOptions(
            allow_pickle=self.allow_pickle,
            meta={"lightning_path": name_of(pointer), "epoch": checkpoint.get("epoch")},
        )
        state = _with_hparams_checked(checkpoint, self.allow_pickle)
        kwargs: dict[str, Any] = {"step": step, "options": save_options, "no_dist": True}
        kwargs["storage_options"] = options
        if not self.async_save:
            try:
                info = save(state, root, **kwargs)
                self._point(pointer, root, info.id, step, options)
            finally:
                shut_down_idle_pools()
            return
        if self._saver is None:
            self._saver = AsyncSaver()
        handle = async_save(state, root, saver=self._saver, **kwargs)
        handle.add_done_callback(lambda h: self._committed(h, pointer, root, step, options))

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint ``path`` points to. ``map_location`` as ``torch.load`` takes it (a
        device, a ``{saved: wanted}`` dict, or ``fn(storage, "cpu")`` returning a moved storage
        or None to keep it). ``CheckpointNotFoundError`` (a ``FileNotFoundError``) when there
        is no file at ``path``."""
        self.wait()
        root, snapshot_id = read_pointer(path, self.storage_options)
        try:
            checkpoint = read(
                root,
                snapshot_id,
                allow_pickle=self.allow_pickle,
                storage_options=self.storage_options,
            )
        finally:
            shut_down_idle_pools()
        out: dict[str, Any] = (
            checkpoint if map_location is None else _map_location(checkpoint, map_location)
        )
        return out

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the file at ``path``; when it is a trainsnap pointer into this plug-in's root
        (not a link to one), also delete its snapshot and collect what no snapshot uses."""
        self.wait()  # the save of this path may still be in flight
        pointer = path_text(path)
        if not path_exists(pointer, self.storage_options):
            return
        owned = None
        if not is_link(pointer):
            try:
                owned = self._owned(pointer, self.storage_options)
            except IncompatibleError as e:
                log.warning("removing %s, which is not a trainsnap pointer: %s", pointer, e)
        remove_path(pointer, self.storage_options)
        if owned is not None:
            try:
                self._drop(owned[0], owned[1], pointer, self.storage_options)
            finally:
                shut_down_idle_pools()

    def teardown(self) -> None:
        """Wait for the save in flight (Lightning calls this at the end of each ``fit``,
        ``validate``, ``test``); raise the error of a failed background save."""
        try:
            if self._saver is not None:
                self._saver.close()
                self._saver = None
        finally:
            shut_down_idle_pools()
        self._raise_background_error()

    # -- helpers ------------------------------------------------------------------------------

    def wait(self) -> None:
        """Wait until no save is in flight; raise the error of a failed background save."""
        if self._saver is not None:
            self._saver.wait()
        self._raise_background_error()

    def _point(
        self, pointer: str, root: Root, snapshot_id: str, step: int, options: dict[str, Any]
    ) -> None:
        """Point ``pointer`` at the committed snapshot; the snapshot it named before (Lightning
        overwrites ``last.ckpt``) is deleted when it is in this plug-in's root."""
        previous = None
        if path_exists(pointer, options) and not is_link(pointer):
            try:
                previous = self._owned(pointer, options)
            except IncompatibleError:
                previous = None  # a torch checkpoint overwritten: nothing of ours to drop
        write_pointer(pointer, root, snapshot_id, step, options)
        if previous is not None and previous[1] != snapshot_id:
            self._drop(previous[0], previous[1], pointer, options)

    def _owned(self, pointer: str, options: dict[str, Any]) -> tuple[Root, str] | None:
        """(root, snapshot) ``pointer`` names when that root is this plug-in's; None (with a
        warning) when it names another: trainsnap deletes and collects only in its own root."""
        root, snapshot_id = read_pointer(pointer, options)
        mine = self._root_for(pointer)
        if same_root(root, mine):
            return mine, snapshot_id
        log.warning(
            "%s points into %s, not into this plug-in's root %s: its snapshot %s is left alone",
            pointer,
            root,
            mine,
            snapshot_id,
        )
        return None

    def _drop(self, root: Root, snapshot_id: str, pointer: str, options: dict[str, Any]) -> None:
        try:
            delete(root, snapshot_id, storage_options=options)
        except NotFoundError:
            log.warning("%s named snapshot %s, which is already gone", pointer, snapshot_id)
        # A save of another path may be in flight: objects younger than the grace period stay.
        collection.collect(open_storage(root, **options), grace=600.0)

    def _root_for(self, pointer: str) -> Root:
        if self.root is None:
            self.root = join_path(parent_of(pointer), DEFAULT_ROOT)
        return self.root

    def _committed(
        self, handle: SaveHandle, pointer: str, root: Root, step: int, options: dict[str, Any]
    ) -> None:
        try:
            info = handle.wait()
            self._point(pointer, root, info.id, step, options)
        except BaseException as e:  # raised by the next save, load or teardown
            with self._lock:
                self._errors.append(e)
        finally:
            shut_down_idle_pools()

    def _raise_background_error(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]


# -- hyper-parameters ---------------------------------------------------------------------------


class _Pickled:
    """A value the user allowed to pickle, kept from being walked as a stateful object (whose
    state dict would come back in its place); unpickling gives back the value itself."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _itself, (self.value,)


def _itself(value: Any) -> Any:
    return value


def _with_hparams_checked(checkpoint: dict[str, Any], allow_pickle: PickleKeys) -> dict[str, Any]:
    """``checkpoint`` with each stateful object in its hyper-parameters (a module, an
    optimizer) marked to be pickled where ``allow_pickle`` covers it; refused otherwise, since
    its state dict would come back in its place. Lightning's dict is not modified."""
    out = dict(checkpoint)
    for key in HPARAMS_KEYS:
        if key in out:
            out[key] = _hparam(out[key], key, allow_pickle)
    return out


def _hparam(value: Any, key: str, allow_pickle: PickleKeys) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if is_stateful(value):
        if pickle_allowed(allow_pickle, key):
            return _Pickled(value)
        raise InvalidArgumentError(
            f"cannot save hyper-parameter {key!r}: it is a {type(value).__name__}, which would "
            "be saved as its state dict and come back as that dict instead of the object. Leave "
            f"it out (self.save_hyperparameters(ignore=[{key.rsplit('.', 1)[-1]!r}])) or let "
            "it be pickled: TrainsnapCheckpointIO(allow_pickle=('hyper_parameters',))",
            key=key,
        )
    if isinstance(value, Mapping):
        items = {k: _hparam(v, f"{key}.{k}", allow_pickle) for k, v in value.items()}
        try:  # Lightning's AttributeDict stays one
            return type(value)(items) if isinstance(value, dict) else items
        except TypeError:  # a dict type that cannot be rebuilt from a dict
            return items
    if isinstance(value, list | tuple) and type(value) in (list, tuple):
        return type(value)(_hparam(v, f"{key}.{i}", allow_pickle) for i, v in enumerate(value))
    return value


def _map_location(checkpoint: Any, where: Any) -> Any:
    """Tensors moved as ``torch.load(map_location=where)`` would move tensors saved on CPU."""
    if isinstance(checkpoint, torch.Tensor):
        return _moved(checkpoint, where)
    if isinstance(checkpoint, dict):
        return type(checkpoint)((k, _map_location(v, where)) for k, v in checkpoint.items())
    if isinstance(checkpoint, list | tuple) and type(checkpoint) in (list, tuple):
        return type(checkpoint)(_map_location(v, where) for v in checkpoint)
    return checkpoint


def _moved(tensor: torch.Tensor, where: Any) -> torch.Tensor:
    if callable(where):
        storage = where(tensor.untyped_storage(), "cpu")  # None: keep it where it is
        return tensor if storage is None else tensor.to(storage.device)
    if isinstance(where, dict):
        target = where.get("cpu")
        return tensor if target is None else tensor.to(target)
    return tensor.to(where)


def load_from_checkpoint(
    cls: Any,
    path: Any,
    *,
    map_location: Any | None = None,
    strict: bool | None = None,
    allow_pickle: PickleKeys = False,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path)`` for a trainsnap pointer (Lightning's own reads the
    file with ``torch.load``): the module built from the saved hyper-parameters (overridden by
    ``kwargs``), its weights loaded."""
    from lightning.pytorch.core.saving import _load_state

    checkpoint = TrainsnapCheckpointIO(allow_pickle=allow_pickle).load_checkpoint(
        path, map_location=map_location
    )
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    return _load_state(cls, checkpoint, strict=strict, **kwargs)


def _saved_keys(root: Root, snapshot_id: str, storage_options: dict[str, Any]) -> list[Any]:
    """The top-level keys a snapshot holds (from its manifest; no data is read)."""
    manifest = commit.open_snapshot(open_storage(root, **storage_options), snapshot_id)
    if manifest.tree is None:
        return sorted({key.split(".", 1)[0] for key in manifest.tensor_keys + manifest.value_keys})
    return [key for key, _ in tree.items(manifest.tree)]


class TrainsnapModelParallelStrategy(_ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel over a device mesh),
    checkpointing through trainsnap: every rank saves its own shards collectively -- nothing is
    gathered to rank 0 -- and loads its shards of any saved layout, straight into its DTensors.
    Rank 0 writes the pointer after the commit, as :class:`TrainsnapCheckpointIO` does.

        strategy = TrainsnapModelParallelStrategy(root, data_parallel_size=2)
        trainer = lightning.Trainer(strategy=strategy, ...)
    """

    def __init__(
        self,
        root: Root | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.storage_options = dict(storage_options or {})
        self._trainsnap = TrainsnapCheckpointIO(root, storage_options=self.storage_options)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        pointer = self.broadcast(path_text(filepath))
        root = self.broadcast(path_text(self._trainsnap._root_for(pointer)))
        step = int(checkpoint.get("global_step", 0))
        # Every rank saves its own DTensor shards; the coordinator commits.
        info = save(checkpoint, root, step=step, storage_options=self.storage_options)
        if self.global_rank == 0:
            self._trainsnap._point(pointer, root, info.id, step, self.storage_options)
        self.barrier("trainsnap.save_checkpoint")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        root, snapshot_id = read_pointer(
            self.broadcast(path_text(checkpoint_path)), self.storage_options
        )
        model = self.model
        assert model is not None, "load_checkpoint runs after the strategy set the model up"
        # Everything saved, as placeholders; the model's and optimizers' own (sharded) state dicts
        # as destinations (torch initialises a fresh optimizer's moments to load into).
        template: dict[str, Any] = dict.fromkeys(
            _saved_keys(root, snapshot_id, self.storage_options)
        )
        template["state_dict"] = get_model_state_dict(model)
        template["optimizer_states"] = [get_optimizer_state_dict(model, o) for o in self.optimizers]
        load(template, root, snapshot=snapshot_id, storage_options=self.storage_options)
        set_model_state_dict(model, template.pop("state_dict"))
        for optimizer, state in zip(self.optimizers, template.pop("optimizer_states"), strict=True):
            set_optimizer_state_dict(
                model, optimizer, state, options=StateDictOptions(strict=False)
            )
        return template


__all__ = [
    "CheckpointNotFoundError",
    "TrainsnapCheckpointIO",
    "TrainsnapModelParallelStrategy",
    "TrainsnapPointerFile",
    "load_from_checkpoint",
    "read_pointer",
]
