"""One model of the family, as stored in ``bucket_family.json``: its shape, its variants' steps,
what "auto" chose, and auto − 25 MB paired round by round."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.results.schema import Record


@dataclass(frozen=True)
class FamilyRecord(Record):
    """A model's run: the step benchmark's records of its variants, and the auto-vs-default figures."""

    KIND: ClassVar[str] = "bucket_family"
    VERSION: ClassVar[int] = 1

    model: str  # key of cs336_systems.bench.family.FAMILY
    shape: str  # what its gradients look like
    n_parameters: int
    n_tensors: int  # parameters with a gradient (one all-reduce each, unbucketed)
    gradient_bytes: int  # s: bytes all-reduced per step
    largest_parameter_bytes: int
    context_length: int
    global_batch: int
    steps: list[StepRecord]  # compute-only, bucketed-auto, bucketed-25MB, torch-ddp (step benchmark records)
    calibration_o_s: float  # auto's all-reduce calibration at construction
    calibration_w_bytes_per_s: float
    model_cap_bytes: float  # the overhead model's cap sqrt(s w o) (at most s)
    candidate_caps_bytes: list[float]  # the distinct layouts auto timed, the default first
    candidate_median_s: list[float | None]  # per candidate: median tuning step, slowest rank (None: not timed)
    chosen_cap_bytes: float  # what auto kept
    tuning_steps: int  # synchronised steps auto spent choosing (the first included)
    auto_minus_default_s: float  # median over rounds of (auto's step - 25 MB's step)
    auto_minus_default_ci95_s: list[float] | None  # its sign-test interval; None: too few rounds
