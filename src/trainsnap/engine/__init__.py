"""The I/O engine: the thread pool, host buffers, the writer and the verified reader, staging.

Imports :mod:`trainsnap.format` and :mod:`trainsnap.storage`. Internal.
"""
