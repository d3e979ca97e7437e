"""Random number generators as restorable state, and randomness that does not depend on ranks.

:func:`capture` / :func:`restore` take and put back every generator a training step may draw
from: Python's ``random``, NumPy's global generator, torch's CPU generator and every CUDA
device's. These are per-rank state: a rank restores its own.

:func:`derive_seed`, :func:`generator` and :func:`fork` derive randomness from (seed, step,
global sample index) instead, so that dropout masks and augmentations are the same whatever the
data-parallel layout -- the randomness a resume on a different number of ranks can reproduce.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from trainsnap.errors import CorruptError, IncompatibleError

_MASK64 = (1 << 64) - 1


def _mix(z: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit integers with good avalanche."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def derive_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed that depends on ``seed`` and every part, in order (e.g. step, sample id)."""
    z = _mix(seed & _MASK64)
    for p in parts:
        z = _mix(z ^ (p & _MASK64))
    return z >> 1


def generator(seed: int, *parts: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A fresh torch generator seeded from (seed, *parts)."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(seed, *parts))
    return g


@contextmanager
def fork(seed: int, *parts: int) -> Iterator[None]:
    """Run a block with torch's global generators seeded from (seed, *parts), then put the
    previous state back: code that draws from the global generator (``nn.Dropout``) becomes a
    function of the seed and the parts, not of what ran before on this rank."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(derive_seed(seed, *parts))
        yield


def capture() -> dict[str, Any]:
    """Every generator's state on this rank, as tensors and plain data."""
    py = random.getstate()
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": py[0], "state": list(py[1]), "gauss": py[2]},
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


PLAIN_KEYS = (
    *(f"rng.python.{name}" for name in ("version", "state", "gauss")),
    *(f"rng.numpy.{name}" for name in ("name", "pos", "has_gauss", "gauss")),
)
"""The saved keys of the RNG state's plain parts (Python's state, NumPy's scalars)."""


def check_plain(values: Mapping[str, Any], generators: Collection[str]) -> None:
    """Raise :class:`CorruptError` unless the plain parts of the saved state of
    ``generators`` (``python``, ``numpy``), read into ``values`` by key, would restore:
    checked before a load reads any tensor, since tensors are filled in place."""
    state: dict[str, Any] = {}
    if "python" in generators:
        state["python"] = _saved(values, "python", ("version", "state", "gauss"))
    if "numpy" in generators:
        numpy = _saved(values, "numpy", ("name", "pos", "has_gauss", "gauss"))
        state["numpy"] = {**numpy, "keys": torch.zeros(624, dtype=torch.int64)}
    check(state)


def _saved(values: Mapping[str, Any], generator: str, names: tuple[str, ...]) -> dict[str, Any]:
    try:
        return {name: values[f"rng.{generator}.{name}"] for name in names}
    except KeyError as e:
        raise CorruptError(
            f"the snapshot's {generator} RNG state lacks {e.args[0]!r}; nothing was applied. "
            "Load at level 'training' to skip it, or restore an older snapshot",
            key="rng",
        ) from e


def check(state: Mapping[str, Any]) -> None:
    """Raise :class:`CorruptError` unless :func:`restore` would accept ``state`` (every
    generator it holds): it is tried on fresh generators, so a load can refuse it before it
    applies anything else."""
    try:
        if "python" in state:
            py = state["python"]
            random.Random().setstate((py["version"], tuple(py["state"]), py["gauss"]))
        if "numpy" in state:
            n = state["numpy"]
            keys = n["keys"].numpy().astype(np.uint32)
            np.random.RandomState().set_state(
                (n["name"], keys, n["pos"], n["has_gauss"], n["gauss"])
            )
        if "torch" in state:
            torch.Generator().set_state(state["torch"])
        cuda = state.get("cuda")
        if (
            cuda is not None
            and torch.cuda.is_available()
            and len(cuda) != torch.cuda.device_count()
        ):
            raise ValueError(
                f"it holds CUDA RNG state of {len(cuda)} devices, this process sees "
                f"{torch.cuda.device_count()}"
            )
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, IndexError) as e:
        raise CorruptError(
            f"the snapshot's RNG state cannot be restored ({type(e).__name__}: {e}); nothing was "
            "applied. Load at level 'training' to skip it, or restore an older snapshot",
            key="rng",
        ) from e


def restore(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture` took, each generator ``state`` holds (a restore may keep
    only some: the others stay as they are). CUDA only where the saved and present devices
    agree."""
    if "python" in state:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    if "numpy" in state:
        n = state["numpy"]
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["gauss"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise IncompatibleError(
                f"the snapshot holds CUDA RNG state of {len(cuda)} devices, this process sees "
                f"{torch.cuda.device_count()}: restore it where as many devices are visible, or "
                "load at level 'training' (no RNG)",
                key="rng",
            )
        torch.cuda.set_rng_state_all(cuda)


def template() -> dict[str, Any]:
    """A state of the right structure for loading into (filled by a load, then restored)."""
    return capture()
