"""``bucket_size_mb="auto"``: this job's all-reduce measured, candidate bucket caps from the
overhead model, and the few first steps that time them and keep the fastest
(:class:`AutoBucketedDDP`, bucketed DDP that does all of this and then trains as it does).

:func:`calibrate_allreduce` is the one calibration of the repo: ``AutoBucketedDDP`` runs it with
its defaults when asked for ``"auto"``, and the doctor (``cs336_systems/doctor``) with its own
payloads and iterations. It times a few all-reduces of growing payloads on the job's own
process group and devices, nccl-tests style: every rank starts each iteration together (a
barrier), the clock is read after the device has finished, each iteration's time is the
slowest rank's, and each payload's time is the median over its iterations. It also checks that
every sum came out exact. Every rank gets the same numbers and so takes the same decisions
(bucket layouts must match across ranks).

The fit and its one fallback rule (:func:`fit_calibration`): ``time = o + bytes / w`` is fitted
by relative least squares (overhead_model.fit_latency_bandwidth), and then

* a negative intercept means the per-call cost is below what the timings resolve: ``o = 0``
  (the model then asks for the smallest buckets allowed, one per largest parameter);
* when the time does not grow with the payload there is no slope to fit (noise swamped the
  bandwidth term): ``o`` is the smallest payload's time, all of it fixed cost, and ``w`` the
  largest payload's bytes over its time, the lowest bandwidth the timings allow.

Either way ``o >= 0`` and ``w > 0``, and :attr:`AllReduceCalibration.note` says what was done.

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
from cs336_systems.ddp.overhead_model import fit_latency_bandwidth, optimal_bucket_bytes
from cs336_systems.units import KB, MB

# Small enough to cost milliseconds on gloo, large enough that the bandwidth term shows.
CALIBRATION_PAYLOAD_BYTES = (64 * KB, 512 * KB, 4 * MB)
CALIBRATION_ITERS = 5
FLOAT32_BYTES = 4
AUTO = "auto"  # the bucket_size_mb that asks for AutoBucketedDDP
DEFAULT_BUCKET_BYTES = DEFAULT_BUCKET_MB * MB
NEIGHBOUR_FACTOR = 2.0  # the model's cap is tried beside this factor below and above it
TUNING_ROUNDS = 4  # timed steps of each candidate; a sign test over 4 rounds errs at most 1 time in 16


@dataclass(frozen=True)
class AllReduceCalibration:
    payload_bytes: tuple[int, ...]
    seconds: tuple[float, ...]  # per payload: median over iterations of the slowest rank's time
    correct: tuple[bool, ...]  # per payload: every rank's every sum was exact
    o_s: float  # per-call overhead, >= 0
    w_bytes_per_s: float  # bandwidth (algbw), > 0
    r2: float | None  # quality of the linear fit; None when there was no fit
    note: str | None = None  # the fallback applied (see the module docstring), if any


def fit_calibration(
    payload_bytes: Sequence[int], seconds: Sequence[float]
) -> tuple[float, float, float | None, str | None]:
    """``(o, w, r2, note)`` from per-payload times, by the fit and fallback rule above. Pure."""
    try:
        o, w, r2 = fit_latency_bandwidth(payload_bytes, seconds)
    except ValueError:
        # Given distinct payloads and times > 0 (as calibrate_allreduce's are), the fit fails
        # only for want of a positive slope.
        by_size = sorted(zip(payload_bytes, seconds))
        (_, o), (largest, largest_s) = by_size[0], by_size[-1]
        w = largest / largest_s
        return o, w, None, (
            "all-reduce time did not grow with the payload, so no bandwidth could be fitted: o is the "
            f"smallest payload's time ({o * 1e6:.1f} us), w the largest payload over its time "
            f"({w / 1e9:.3f} GB/s)"
        )
    if o < 0:
        return 0.0, w, r2, (
            f"fitted per-call cost o = {o * 1e6:.1f} us is below what the timings resolve; taken as 0"
        )
    return o, w, r2, None


def check_calibration(payload_bytes: Sequence[int], iters: int) -> None:
    """ValueError unless :func:`calibrate_allreduce` can run with these payloads and iterations."""
    if len(set(payload_bytes)) < 2 or any(b <= 0 or b % FLOAT32_BYTES for b in payload_bytes):
        raise ValueError(
            f"calibration needs >= 2 distinct payloads, positive multiples of {FLOAT32_BYTES} bytes; "
            f"got {tuple(payload_bytes)}"
        )
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"calibration iterations must be an integer >= 1, got {iters!r}")


def calibrate_allreduce(
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    payload_bytes: Sequence[int] = CALIBRATION_PAYLOAD_BYTES,
    iters: int = CALIBRATION_ITERS,
) -> AllReduceCalibration:
    """Time ``iters`` all-reduces of each payload (after one warm-up) and fit ``o`` and ``w``.

    A collective: every rank of ``group`` calls it with the same arguments. Payloads are
    float32, so each must be a positive multiple of 4 bytes; at least two distinct ones.
    Each rank fills its payload with ``rank + 1`` before every iteration (outside the timed
    part), so an exact sum is ``n (n + 1) / 2`` everywhere.
    """
    check_calibration(payload_bytes, iters)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    exact_sum = world_size * (world_size + 1) / 2
    local_times: list[float] = []
    wrong: list[float] = []
    for nbytes in payload_bytes:
        payload = torch.empty(nbytes // FLOAT32_BYTES, dtype=torch.float32, device=device)
        dist.all_reduce(payload.fill_(rank + 1), group=group)  # warm-up: connection set-up, allocation
        exact = True
        for _ in range(iters):
            payload.fill_(rank + 1)
            dist.barrier(group=group)  # every rank starts the iteration together
            sync_device(device)
            start = time.perf_counter()
            dist.all_reduce(payload, group=group)
            sync_device(device)
            local_times.append(time.perf_counter() - start)
            exact = exact and bool(torch.all(payload == exact_sum))
        wrong.append(0.0 if exact else 1.0)
    # One collective for all: each iteration's slowest rank, and whether any rank was wrong.
    values = slowest_rank(local_times + wrong, small_tensor_device(device, dist.get_backend(group)), group)
    times, flags = values[: len(local_times)], values[len(local_times):]
    seconds = tuple(statistics.median(times[i * iters : (i + 1) * iters]) for i in range(len(payload_bytes)))
    o, w, r2, note = fit_calibration(payload_bytes, seconds)
    return AllReduceCalibration(tuple(payload_bytes), seconds, tuple(f == 0.0 for f in flags), o, w, r2, note)


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
    :meth:`finish_gradient_synchronization`, slowest rank; see :class:`BucketTuner`). Tuning
    therefore takes 1 + 4 k synchronised steps for k >= 2 distinct layouts, at most 17, and
    only the first step when every candidate builds the same buckets. Only those steps wait
    for the device (to read the clock), and the last one agrees on the choice with one small
    all-reduce; afterwards the step path is :class:`BucketedDDP`'s. Buckets are rebuilt
    between steps, never within one, so training is unchanged (``tests/test_auto_bucket.py``).
    :attr:`tuning` is True while it lasts and :attr:`tuning_result` says what was measured.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **levers: Any):
        """``levers``: BucketedDDP's keyword options (``first_bucket_mb``, ``comm_dtype``, ...)."""
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

    def finish_gradient_synchronization(self) -> None:
        if not self._sync_this_backward:
            return
        super().finish_gradient_synchronization()
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
