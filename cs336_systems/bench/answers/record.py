"""One (technique, implementation) of the answers' step benchmark, as stored in ``answers_step.json``.

Times are the slowest rank's, in seconds, one entry per timed step in round order: entry ``i``
of every record of a run was timed in the same round, which the paired differences rely on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cs336_systems.results.schema import Record


@dataclass(frozen=True)
class AnswersStepRecord(Record):
    """One implementation of one technique: its steps and its difference from the library's."""

    KIND: ClassVar[str] = "answers_step"
    VERSION: ClassVar[int] = 1

    technique: str  # "per-parameter DDP", "bucketed DDP", "sharded optimizer", "FSDP"
    implementation: str  # "answer", "library" or "torch"
    description: str  # what was timed, in words
    step_times_s: list[float]  # slowest rank's time per timed step, in round order
    median_step_s: float
    median_ci95_s: list[float] | None  # sign-test interval of the median; None: too few rounds
    vs_library_s: float | None  # median over rounds of (this step - the library's); None for the library
    vs_library_ci95_s: list[float] | None  # its sign-test interval; None: too few rounds or the library
