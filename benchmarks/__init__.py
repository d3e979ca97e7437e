"""trainsnap's benchmarks: each measures trainsnap and the alternatives on the same data in the
same run. Run them from the repository root as modules, e.g. ``python -m benchmarks.save_load``;
``--smoke`` runs any of them at tiny sizes (what ``tests/test_benchmarks.py`` does).

``benchmarks._framework`` is what they share (methods, adapters, timing, the report); it is no
part of trainsnap's API.
"""
