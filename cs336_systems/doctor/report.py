"""The doctor's report: what one scenario found on every rank, as ``scripts/doctor.py --out`` writes it
(a results file of kind "doctor" holding one :class:`DoctorReport`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cs336_systems.results.schema import Record


@dataclass(frozen=True)
class RankInfo:
    """One row of the report's table."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: str
    hostname: str
    pid: int
    checkin_s: float | None  # when rank 0 saw it check in, from rank 0's start; None: never
    samples: int  # indices its DistributedSampler gave it
    step_s: float  # median time of a whole training step
    compute_s: float  # median forward + backward, before waiting for other ranks' gradients
    fastest_compute_s: float  # the least of those: what straggler detection compares
    wait_s: float  # median time in finish_gradient_synchronization (waiting for the others)
    load_per_core: float | None  # the host's 1-minute load average over its cores, if known


@dataclass(frozen=True)
class CalibrationRow:
    """One payload of the all-reduce calibration (cs336_systems/ddp/auto_bucket.py)."""

    payload_bytes: int
    median_s: float  # median over iterations of the slowest rank's time
    correct: bool  # every rank's every sum was exact


@dataclass(frozen=True)
class DoctorReport(Record):
    """Everything one scenario found; the same on every rank."""

    KIND: ClassVar[str] = "doctor"
    VERSION: ClassVar[int] = 1

    inject: str | None  # the planted fault (setting.INJECTIONS), or None for the healthy run
    model_size: str
    parameter_count: int
    gradient_bytes: int  # s: bytes all-reduced per step
    largest_param_bytes: int
    ranks: list[RankInfo]
    calibration: list[CalibrationRow]  # empty at world size 1: nothing to all-reduce with
    allreduce_o_s: float | None  # per-call cost (None: no calibration)
    allreduce_w_bytes_per_s: float | None  # bandwidth (algbw)
    fit_r2: float | None  # None also when the fit fell back (see auto_bucket.py)
    suggested_bucket_bytes: float | None
    findings: list[str]  # what is wrong; non-empty: exit status 1
    notes: list[str]  # worth knowing, not wrong

    @property
    def ok(self) -> bool:
        return not self.findings
