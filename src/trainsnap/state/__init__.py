"""From user state to entries and back: capture, :class:`~trainsnap.TrainState`, RNG as state,
the elastic sampler.

Imports :mod:`trainsnap.format`. :mod:`trainsnap.state.rng` and
:mod:`trainsnap.state.sampler` are public (as ``trainsnap.rng`` and ``trainsnap.sampler``).
"""
