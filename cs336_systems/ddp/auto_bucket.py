"""``bucket_size_mb="auto"``: this job's all-reduce measured, candidate bucket caps from the
overhead model, and the few first steps that time them and keep the fastest
(:class:`AutoBucketedDDP`, bucketed DDP that does all of this and then trains as it does).

The calibration (this job's all-reduce timed, ``o`` and ``w`` fitted, one fallback rule) is
``calibration.py``'s :func:`calibrate_allreduce`, shared with the doctor; its names are importable
from here too.

Why the model alone does not pick the cap: its optimum ``sqrt(s w o)`` assumes a backward that
produces gradients exactly as fast as the channel moves them, and communication that costs
compute nothing. Neither holds everywhere (on a few CPU cores an all-reduce running beside
backward slows it down; on a GPU backward may be far faster than the link), and a cap a few
times off its best can lose to torch's fixed 25 MB. So the model proposes and the job decides:
:func:`candidate_caps` gives the model's cap, its neighbours (half and double) and the 25 MB
default, and :class:`BucketTuner` times each for a few steps, interleaved round by round (the
slowest rank's time, agreed by all ranks, so that every rank keeps the same cap). It keeps
25 MB unless a candidate beat it in every round, so "auto" leaves the default only on
consistent evidence, and then for the candidate that gained most.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.comm.timing import slowest_rank, small_tensor_device, sync_device
from cs336_systems.ddp.bucketed import DEFAULT_BUCKET_MB, BucketedDDP
from cs336_systems.ddp.calibration import (CALIBRATION_ITERS, CALIBRATION_PAYLOAD_BYTES, AllReduceCalibration,
                                           calibrate_allreduce, check_calibration, fit_calibration)
from cs336_systems.ddp.overhead_model import optimal_bucket_bytes
from cs336_systems.units import MB

# The calibration's names, for the callers that import them from here (the doctor, the tests, the writeup).
__all__ = ["AUTO", "CALIBRATION_ITERS", "CALIBRATION_PAYLOAD_BYTES", "DEFAULT_BUCKET_BYTES", "DEFAULT_BUCKET_MB",
           "TUNING_ROUNDS", "AllReduceCalibration", "AutoBucketedDDP", "BucketTuner", "TuningResult",
           "agree_on_cap", "calibrate_allreduce", "candidate_caps", "check_calibration", "fit_calibration",
           "model_bucket_bytes"]
AUTO = "auto"  # the bucket_size_mb that asks for AutoBucketedDDP
DEFAULT_BUCKET_BYTES = DEFAULT_BUCKET_MB * MB
NEIGHBOUR_FACTOR = 2.0  # the model's cap is tried beside this factor below and above it
TUNING_ROUNDS = 4  # timed steps of each candidate; a sign test over 4 rounds errs at most 1 time in 16


def model_bucket_bytes(
    grad_bytes: int, largest_param_bytes: int, device: torch.device, group: dist.ProcessGroup | None = None
) -> tuple[float, AllReduceCalibration]:
    """The overhead model's cap for a model with ``grad_bytes`` of gradients (collective), and
    the calibration behind it."""
    calibration = calibrate_allreduce(device, group)
    cap = optimal_bucket_bytes(grad_bytes, calibration.w_bytes_per_s, calibration.o_s, largest_param_bytes)
    return cap, calibration


def candidate_caps(model_cap_bytes: float, grad_bytes: float) -> list[float]:
    """The caps worth timing: the 25 MB default first, then the model's cap and its neighbours.

    Each is at most ``grad_bytes`` (a larger cap builds the same one bucket). Duplicates are
    dropped here; caps that build the same buckets are merged by the wrapper, which knows the
    launch order.
    """
    if not (model_cap_bytes > 0 and grad_bytes > 0):
        raise ValueError(f"caps and gradient bytes must be > 0, got {model_cap_bytes!r} and {grad_bytes!r}")
    caps: list[float] = []
    for cap in (DEFAULT_BUCKET_BYTES, model_cap_bytes, model_cap_bytes / NEIGHBOUR_FACTOR,
                model_cap_bytes * NEIGHBOUR_FACTOR):
        cap = float(min(cap, grad_bytes))
        if cap not in caps:
            caps.append(cap)
    return caps


class BucketTuner:
    """Which candidate cap each tuning step uses, the times recorded, and the choice.

    Round ``r`` times every candidate once, the order rotated by ``r`` so that no candidate
    always follows the same one. Pure bookkeeping: the wrapper times the steps, and
    :meth:`choose` is handed the slowest rank's times, so every rank chooses alike.

    The choice respects the noise of so few steps: the default (candidate 0) is kept unless
    another candidate was faster than it in *every* round (each round's two steps ran seconds
    apart, under the same load). A candidate no faster than the default passes that test with
    probability at most ``2**-rounds`` (a sign test: 1/16 with 4 rounds), and a slower one
    less often still. Among those that pass, the one with the lowest median per-round
    difference is kept.
    """

    def __init__(self, caps: Sequence[float], rounds: int = TUNING_ROUNDS):
        if not caps:
            raise ValueError("a tuner needs at least one candidate cap")
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
        self.caps = list(caps)
        self.rounds = rounds
        k = len(self.caps)
        self.schedule = [(r + i) % k for r in range(rounds) for i in range(k)]  # candidate per step
        self.local_times: list[float] = []

    @property
    def done(self) -> bool:
        return len(self.local_times) == len(self.schedule)

    @property
    def steps_left(self) -> int:
        return len(self.schedule) - len(self.local_times)

    @property
    def current_cap(self) -> float:
        """The cap the next timed step uses."""
        return self.caps[self.schedule[len(self.local_times)]]

    def record(self, seconds: float) -> None:
        if self.done:
            raise RuntimeError("every tuning step is already recorded")
        self.local_times.append(seconds)

    def by_round(self, times: Sequence[float]) -> list[list[float]]:
        """``[round][candidate]`` seconds, from one time per scheduled step."""
        if len(times) != len(self.schedule):
            raise ValueError(f"expected {len(self.schedule)} times, one per tuning step, got {len(times)}")
        k = len(self.caps)
        table = [[0.0] * k for _ in range(self.rounds)]
        for step, (t, c) in enumerate(zip(times, self.schedule)):
            table[step // k][c] = t
        return table

    def medians(self, times: Sequence[float]) -> list[float]:
        """Each candidate's median over its steps."""
        table = self.by_round(times)
        return [statistics.median(row[i] for row in table) for i in range(len(self.caps))]

    def choose(self, times: Sequence[float]) -> int:
        """The candidate kept: the default unless another beat it in every round (see the class)."""
        table = self.by_round(times)
        best, best_gain = 0, 0.0
        for i in range(1, len(self.caps)):
            differences = [row[i] - row[0] for row in table]
            if all(d < 0 for d in differences) and statistics.median(differences) < best_gain:
                best, best_gain = i, statistics.median(differences)
        return best


@dataclass(frozen=True)
class TuningResult:
    """What the tuning steps measured and kept (the same on every rank)."""

    caps: tuple[float, ...]  # the distinct candidates timed, the default first
    median_s: tuple[float, ...]  # per candidate: median of the slowest rank's tuning steps (nan: a
    # lone candidate, kept untimed)
    chosen_cap: float


def agree_on_cap(tuner: BucketTuner, device: torch.device, group: dist.ProcessGroup | None) -> TuningResult:
    """Every rank's times reduced to the slowest rank's per step (a collective, and the one host
    wait of the tuning's last step), then the same choice everywhere."""
    times = slowest_rank(tuner.local_times, small_tensor_device(device, dist.get_backend(group)), group)
    best = tuner.choose(times)
    return TuningResult(tuple(tuner.caps), tuple(tuner.medians(times)), tuner.caps[best])


class AutoBucketedDDP(BucketedDDP):
    """Bucketed DDP whose cap this job's first steps choose (``bucket_size_mb="auto"``).

    At construction it calibrates the all-reduce (a collective) and trains its first step with
    the overhead model's cap ``sqrt(s w o)``. After that step it tunes: the distinct bucket
    layouts among the candidates (25 MB, the model's cap, half and double it: 1 to 4) are each
    used for ``TUNING_ROUNDS`` = 4 steps, one per round, and 25 MB's layout is kept unless
    another beat it in every round (steps timed from forward to the end of
    the end of backward's reduction, slowest rank; see :class:`BucketTuner`). Tuning
    therefore takes 1 + 4 k synchronised steps for k >= 2 distinct layouts, at most 17, and
    only the first step when every candidate builds the same buckets. Only those steps wait
    for the device (to read the clock), and the last one agrees on the choice with one small
    all-reduce; afterwards the step path is :class:`BucketedDDP`'s. Buckets are rebuilt
    between steps, never within one, so training is unchanged (``tests/test_auto_bucket.py``).
    :attr:`tuning` is True while it lasts and :attr:`tuning_result` says what was measured.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **levers: Any):
        """``levers``: BucketedDDP's keyword options (``first_bucket_mb``, ``comm_dtype``, ...) and
        torch's DDP keywords but ``bucket_cap_mb``, which this wrapper chooses itself."""
        if levers.get("bucket_cap_mb") is not None:
            raise ValueError(f"AutoBucketedDDP chooses the bucket cap itself; got bucket_cap_mb={levers['bucket_cap_mb']!r} "
                             "(BucketedDDP takes one)")
        super().__init__(module, DEFAULT_BUCKET_MB, process_group, **levers)
        self.bucket_size_mb = AUTO
        sizes = [p.numel() * p.element_size() for p in self.synced_params]
        self._grad_bytes = sum(sizes)
        # Every rank measures together, then decides alike.
        self.model_cap_bytes, self.calibration = model_bucket_bytes(
            self._grad_bytes, max(sizes), self._device, self.process_group
        )
        self.tuning_result: TuningResult | None = None  # set when tuning ends
        self._tuner: BucketTuner | None = None
        self._first_step_pending = True
        self._tuning_start = 0.0
        self._use_cap(self.model_cap_bytes)

    @property
    def _device(self) -> torch.device:
        return self.synced_params[0].device

    @property
    def tuning(self) -> bool:
        """Whether the cap is still being chosen (the next synchronised step is a tuning one)."""
        return self._first_step_pending or self._tuner is not None

    def _plan(self, cap_bytes: float) -> list[list[int]]:
        return replace(self.layout, cap_bytes=cap_bytes).plan(self.launch_order)

    def _use_cap(self, cap_bytes: float) -> None:
        """Rebuild the buckets with ``cap_bytes`` in the current launch order (between steps)."""
        layout = replace(self.layout, cap_bytes=cap_bytes)
        if layout != self.layout:
            self.layout = layout
            self.rebuild_units(layout)

    def _before_forward(self) -> None:
        super()._before_forward()
        if self.tuning:
            sync_device(self._device)  # the clock starts on an idle device
            self._tuning_start = time.perf_counter()

    def _synchronize(self) -> None:
        super()._synchronize()
        if self.tuning:
            self._tuning_step_done()

    def _tuning_step_done(self) -> None:
        """After a synchronised tuning step: record its time, then set up the next step's buckets."""
        sync_device(self._device)
        elapsed = time.perf_counter() - self._tuning_start
        if self._first_step_pending:  # the launch order is settled now, so the layouts are known
            self._first_step_pending = False
            distinct: dict[tuple, float] = {}
            for cap in candidate_caps(self.model_cap_bytes, self._grad_bytes):
                distinct.setdefault(tuple(map(tuple, self._plan(cap))), cap)
            caps = list(distinct.values())
            if len(caps) == 1:
                self.tuning_result = TuningResult((caps[0],), (math.nan,), caps[0])
                self._use_cap(caps[0])
                return
            self._tuner = BucketTuner(caps, TUNING_ROUNDS)
            self._use_cap(self._tuner.current_cap)
            return
        tuner = self._tuner
        assert tuner is not None, "a tuning step after the first one has a tuner"
        tuner.record(elapsed)
        if tuner.done:
            self.tuning_result = agree_on_cap(tuner, self._device, self.process_group)
            self._tuner = None
            self._use_cap(self.tuning_result.chosen_cap)
        else:
            self._use_cap(tuner.current_cap)
