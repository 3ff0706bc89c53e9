"""The handout's problems this repo answers: points, what each asks for, and where it lives.

One list for the grade table printed by ``make test`` (tests/grading.py), for the writeup's
map of problems to sections and tests, and for a newcomer looking for a problem in the tree.
Problems are those of CS336 assignment 2's distributed part, spring 2025 edition (section 2 and
optimizer state sharding), and the FSDP problems the 2026 edition adds; ``edition`` says which.
``make test`` writes the grade table as a results file (kind "grades") that the writeup reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cs336_systems.results.schema import Record
from grading.problems import POINTS as GRADER_POINTS  # the points of the problems the grader knows

# The 2026 edition's section 8, "Analyzing Parallelism Strategies": written answers only, graded by
# hand from the writeup, which the grader's table (grading/problems.py) does not list.
SECTION8_POINTS = {"alternate_ring_all_reduce": 1, "data_parallel_calcs": 3, "fsdp_calcs": 3, "tp_calcs": 4,
                   "fsdp_tp_calcs": 6}
POINTS = {**GRADER_POINTS, **{name: (points, ("2026",)) for name, points in SECTION8_POINTS.items()}}

CODE, MEASURED, WRITTEN = "code", "measured", "written"  # what a problem's deliverable is


@dataclass(frozen=True)
class Problem:
    name: str  # the handout's name for it
    deliverable: str  # CODE (graded by tests), MEASURED (a benchmark and its writeup), WRITTEN (analysis)
    where: tuple[str, ...]  # the code that answers it, from the repository root
    tested: bool  # graded by the test suite (the grade table's rows)

    @property
    def points(self) -> int:
        """The handout's points (grading/problems.py; section 8's from SECTION8_POINTS)."""
        return POINTS[self.name][0]

    @property
    def edition(self) -> str:
        """"2025", "2026" or "both"."""
        editions = POINTS[self.name][1]
        return editions[0] if len(editions) == 1 else "both"


PROBLEMS: tuple[Problem, ...] = (
    Problem("distributed_communication_single_node", MEASURED,
            ("cs336_systems/bench/allreduce/", "scripts/bench_allreduce.py"), True),
    Problem("naive_ddp", CODE,
            ("cs336_systems/ddp/naive.py", "cs336_systems/bench/equivalence.py", "scripts/naive_ddp.py"), True),
    Problem("naive_ddp_benchmarking", MEASURED, ("cs336_systems/bench/step/", "scripts/bench_ddp.py"), True),
    Problem("minimal_ddp_flat_benchmarking", MEASURED,
            ("cs336_systems/ddp/flat.py", "cs336_systems/bench/step/"), True),
    Problem("ddp_overlap_individual_parameters", CODE,
            ("cs336_systems/ddp/per_parameter.py", "cs336_systems/ddp/overlap.py"), True),
    Problem("ddp_overlap_individual_parameters_benchmarking", MEASURED,
            ("cs336_systems/bench/step/", "cs336_systems/bench/profile/", "scripts/profile_ddp.py"), True),
    Problem("ddp_overlap_bucketed", CODE,
            ("cs336_systems/ddp/bucketed.py", "cs336_systems/ddp/bucket.py", "cs336_systems/ddp/overlap.py"), True),
    Problem("ddp_bucketed_benchmarking", MEASURED,
            ("cs336_systems/bench/step/", "cs336_systems/ddp/overhead_model.py"), True),
    Problem("communication_accounting", WRITTEN,
            ("cs336_systems/capacity/", "cs336_systems/writeup/communication_accounting_section.py"), False),
    Problem("optimizer_state_sharding", CODE, ("cs336_systems/zero/",), True),
    Problem("optimizer_state_sharding_accounting", MEASURED,
            ("cs336_systems/bench/accounting/", "scripts/bench_sharded_optimizer.py"), False),
    Problem("fsdp", CODE, ("cs336_systems/fsdp/",), True),
    Problem("fsdp_accounting", MEASURED, ("cs336_systems/bench/fsdp/", "scripts/bench_fsdp.py"), False),
    *(Problem(name, WRITTEN, ("cs336_systems/capacity/strategies.py", "cs336_systems/capacity/ring.py",
                              "cs336_systems/capacity/ffn_check.py", "cs336_systems/writeup/parallelism_section.py"),
              False) for name in SECTION8_POINTS),
)
BY_NAME = {p.name: p for p in PROBLEMS}
TESTED_POINTS = {p.name: p.points for p in PROBLEMS if p.tested}


@dataclass(frozen=True)
class GradeRecord(Record):
    """One row of the grade table ``make test`` printed."""

    KIND: ClassVar[str] = "grades"
    VERSION: ClassVar[int] = 1

    problem: str  # a Problem's name, or "beyond" for tests of our own additions
    passed: int
    total: int  # tests that ran (skipped ones are not counted)
    skipped: int
    points: float | None  # earned: the problem's points times passed / total; None for "beyond"
    possible: int | None
    files: dict[str, list[int]]  # each test file that grades it -> [passed, total]
    failed: list[str]  # test ids that failed
