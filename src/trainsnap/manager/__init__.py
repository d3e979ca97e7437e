"""The CheckpointManager and what it runs: policies, the writer lease and restart log, garbage
collection, tiers, quantized history.

Imports :mod:`trainsnap.api` and below.
"""
