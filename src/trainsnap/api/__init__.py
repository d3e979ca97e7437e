"""The public entry points (save, async_save, load, list_snapshots, verify) and their options.

Imports :mod:`trainsnap.protocol` and below; re-exported by :mod:`trainsnap`.
"""
