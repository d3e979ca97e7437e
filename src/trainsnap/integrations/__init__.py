"""One-line integrations with the training stacks people use (each an optional extra).

Imports :mod:`trainsnap.manager` and below.
"""
