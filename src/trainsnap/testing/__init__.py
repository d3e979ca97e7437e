"""Testing multi-rank code with real processes: :func:`run_ranks` spawns N CPU ranks over gloo,
with a hard deadline, and collects what each did. Public.
"""

from trainsnap.testing.harness import RankResult, assert_all_ok, errors_by_rank, run_ranks

__all__ = ["RankResult", "assert_all_ok", "errors_by_rank", "run_ranks"]
