"""The cross-rank protocols: the control plane, the global planner, each rank's part of a save
and a load, assembling the manifest, the commit, and what ranks learn at the end.

Imports :mod:`trainsnap.state`, :mod:`trainsnap.engine`, :mod:`trainsnap.format` and
:mod:`trainsnap.storage`. Internal.
"""
