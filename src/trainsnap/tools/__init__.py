"""The command line and what it runs: listing and rendering, diff, export, DCP import, the demo.

Imports everything below it. Internal, except the ``trainsnap`` command itself.
"""
