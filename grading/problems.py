"""The handout's problems, their points, and which of them the hidden-style suite grades.

Points are the handout's: CS336 assignment 2, spring 2025 edition (section 2, distributed data
parallel training, and optimizer state sharding), and the 2026 edition, which adds FSDP and calls
the per-parameter DDP adapter ``get_ddp``. A problem the suite grades splits its points evenly
over its tests; the rest (benchmarks and written answers) are graded by hand from the writeup.
"""

from __future__ import annotations

# name -> (points, editions it appears in)
POINTS: dict[str, tuple[int, tuple[str, ...]]] = {
    "distributed_communication_single_node": (5, ("2025", "2026")),
    "naive_ddp": (5, ("2025", "2026")),
    "naive_ddp_benchmarking": (3, ("2025", "2026")),
    "minimal_ddp_flat_benchmarking": (2, ("2025", "2026")),
    "ddp_overlap_individual_parameters": (5, ("2025", "2026")),
    "ddp_overlap_individual_parameters_benchmarking": (1, ("2025", "2026")),
    "ddp_overlap_bucketed": (8, ("2025",)),
    "ddp_bucketed_benchmarking": (3, ("2025",)),
    "communication_accounting": (10, ("2025",)),
    "optimizer_state_sharding": (15, ("2025", "2026")),
    "optimizer_state_sharding_accounting": (5, ("2025", "2026")),
    "fsdp": (15, ("2026",)),
    "fsdp_accounting": (5, ("2026",)),
}

# The adapters each edition's public tests/adapters.py declares (the distributed part).
EDITION_ADAPTERS: dict[str, tuple[str, ...]] = {
    "2025": ("get_ddp_individual_parameters", "ddp_individual_parameters_on_after_backward",
             "get_ddp_bucketed", "ddp_bucketed_on_after_backward", "ddp_bucketed_on_train_batch_start",
             "get_sharded_optimizer"),
    "2026": ("get_ddp", "ddp_on_after_backward", "get_fsdp", "fsdp_on_after_backward",
             "fsdp_gather_full_params", "get_sharded_optimizer"),
}

# The problems the suite grades, per edition; "both" is this repository, which answers both.
GRADED: dict[str, tuple[str, ...]] = {
    "2025": ("ddp_overlap_individual_parameters", "ddp_overlap_bucketed", "optimizer_state_sharding"),
    "2026": ("ddp_overlap_individual_parameters", "optimizer_state_sharding", "fsdp"),
}
GRADED["both"] = tuple(p for p in POINTS if p in GRADED["2025"] + GRADED["2026"])
EDITIONS = ("2025", "2026", "both")


def in_edition(problem: str, edition: str) -> bool:
    return edition == "both" or edition in POINTS[problem][1]


def hand_graded(edition: str) -> list[str]:
    """The edition's problems the suite does not grade: benchmarks and written answers."""
    return [p for p in POINTS if in_edition(p, edition) and p not in GRADED[edition]]
