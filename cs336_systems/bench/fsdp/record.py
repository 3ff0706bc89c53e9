"""One configuration of the FSDP step benchmark, as stored in ``fsdp_step.json``.

Times are the slowest rank's, in seconds, one entry per timed step in round order: entry ``i``
of every configuration of a run was timed in the same round, which the paired differences
rely on. Memory is per rank (the largest rank's), in bytes, counted over one untimed step;
communication is per rank and step, in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cs336_systems.results.schema import Record

# Collective kinds, as counted (see accounting.py) and as the timeline's lanes.
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST = "all_gather", "reduce_scatter", "all_reduce", "broadcast"
COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST)
# The memory split of the peak, in this order everywhere.
MEMORY_PARTS = ("parameters", "gradients", "optimizer_state", "activations")


@dataclass(frozen=True)
class FsdpTimeline:
    """One traced step of rank 0: intervals as [start, end] seconds since the step began."""

    duration_s: float
    phases: dict[str, list[float]]  # "forward", "backward", "finish", "optimizer_step"
    compute: list[list[float]]  # merged: the main thread inside a tensor operation
    collectives: dict[str, list[list[float]]]  # kind -> [launched, completed] per call, launch order
    waits: list[list[float]]  # the rank blocked in Work.wait
    timed_median_s: float  # the configuration's median timed step, to judge the tracing's cost


@dataclass(frozen=True)
class FsdpStepRecord(Record):
    """One configuration's steps, memory, communication and the largest model it would fit."""

    KIND: ClassVar[str] = "fsdp_step"
    VERSION: ClassVar[int] = 2  # 2: fsdp_mode

    configuration: str  # "ddp", "zero1", "fsdp", "torch-fsdp" (see configurations.py)
    description: str  # what it is, in words
    # Our FSDP's mode as timed: "reduce-scatter" (the default, what adapters.get_fsdp builds) or
    # "exact-gradients"; None for the other configurations.
    fsdp_mode: str | None
    step_times_s: list[float]  # slowest rank's time per timed step, in round order
    median_step_s: float
    min_step_s: float
    max_step_s: float
    vs_fsdp_s: float | None  # median over rounds of (this step - our FSDP's step); None for ours
    vs_fsdp_ci95_s: list[float] | None  # its sign-test interval [low, high]; None: too few rounds
    tokens_per_s: float  # tokens of the global batch per median step
    steps_timed: int
    n_parameters: int  # of the model (every configuration trains the same one)
    # Memory per rank over one step (the largest rank's), split at the moment of the peak.
    peak_bytes: float
    peak_parameters_bytes: float  # parameters and buffers: resident shards and gathered weights
    peak_gradients_bytes: float  # .grad, gradient buckets, full gradients awaiting reduction
    peak_optimizer_state_bytes: float
    peak_activations_bytes: float  # everything else: activations, saved tensors, temporaries
    resident_bytes: float  # alive between steps
    allocator_peak_bytes: float | None  # CUDA's allocator over the step (None on a CPU)
    # Communication per rank and step.
    payload_bytes: dict[str, float]  # kind -> bytes of the full buffers the collectives move
    calls: dict[str, int]  # kind -> collective calls
    traffic_bytes: float  # bytes each rank sends: ring algorithms, from the payloads
    formula_traffic_bytes: float  # the textbook expectation (see formulas.py)
    # The largest model it would fit (computed from the measured memory, not trained).
    bytes_per_parameter: float  # (parameters + gradients + optimizer state at the peak) / n_parameters
    free_bytes_per_rank: float  # memory free when the run started, shared by the node's ranks
    largest_parameters: float  # (free - activations) / bytes per parameter
    largest_model_size: str | None  # the largest of MODEL_SIZES within it; None: not even the smallest
    timeline: FsdpTimeline | None = None  # our FSDP's and torch's only

    @property
    def peak_parts(self) -> dict[str, float]:
        return {
            "parameters": self.peak_parameters_bytes,
            "gradients": self.peak_gradients_bytes,
            "optimizer_state": self.peak_optimizer_state_bytes,
            "activations": self.peak_activations_bytes,
        }
