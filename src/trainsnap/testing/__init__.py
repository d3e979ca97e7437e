"""Testing multi-rank code with real processes: :func:`run_ranks` spawns N CPU ranks over gloo,
with a hard deadline, and collects what each did; :func:`check_resume` tells whether a training
loop resumes exactly, and where it first drifts if not. Public.
"""

from trainsnap.testing.harness import RankResult, assert_all_ok, errors_by_rank, run_ranks
from trainsnap.testing.resume_check import ResumeReport, check_resume

__all__ = [
    "RankResult",
    "ResumeReport",
    "assert_all_ok",
    "check_resume",
    "errors_by_rank",
    "run_ranks",
]
