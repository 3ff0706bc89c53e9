"""The DDP doctor: one short diagnostic run that checks a job's data-parallel set-up, rank by rank.

It answers the questions asked when DDP "only trains on one rank" or hangs:

* did every rank start and reach the first step? Each rank checks in through the rendezvous
  store (a key per rank); rank 0 names the ranks missing after ``checkin_timeout_s``. A store
  key, unlike a collective, says *which* rank is missing;
* is one rank slower than the others? Each rank times the compute of a few training steps
  (forward and backward, before waiting for gradients), since in DDP the other ranks'
  step time includes waiting for the slowest one;
* do the ``DistributedSampler`` shards split the data? Every rank's indices are gathered and
  checked for overlaps and for indices no rank gets;
* do the replicas hold the same parameters? Checksums of every parameter are compared across
  ranks before any broadcast, after wrapping in DDP, and after the training steps;
* what do all-reduces cost here? A short calibration fits ``time = o + bytes / w`` and suggests
  the bucket size ``sqrt(s w o)`` for the model's ``s`` gradient bytes
  (:mod:`cs336_systems.ddp.overhead_model`).

Each problem becomes a *finding*: a sentence that says what is wrong, with the values seen, and
what usually causes it. The pure ``find_*`` functions turn gathered data into findings;
:func:`run_doctor` runs the ranks (spawned here, or this process as one rank under torchrun).
``inject`` plants one known fault, to test the doctor and to show what each finding looks like.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

from cs336_systems.allreduce_benchmark import time_payload
from cs336_systems.ddp import BucketedDDP
from cs336_systems.units import KB, MB
from cs336_systems.doctor_findings import (  # noqa: F401  (re-exported: the doctor's API)
    SHOWN,
    BEFORE_BROADCAST,
    AFTER_WRAPPING,
    AFTER_TRAINING,
    STAGE_CAUSES,
    find_missing_ranks,
    find_shard_problems,
    find_parameter_mismatches,
    find_stragglers,
    ranks_text,
)
from cs336_systems.model import MODEL_SIZES, TransformerLM, count_parameters, model_config
from cs336_systems.ddp.overhead_model import fit_latency_bandwidth, optimal_bucket_bytes
from cs336_systems.launch import RankContext, check_devices, run_ranks, running_under_launcher


UNSEEDED = "unseeded-no-broadcast"  # each rank seeds differently; the raw model trains unwrapped
OVERLAPPING_SHARDS = "overlapping-shards"  # every rank builds its sampler as if it were rank 0
STRAGGLER = "straggler"  # rank 1 sleeps in every step
MISSING_RANK = "missing-rank"  # rank 1 checks in only after rank 0 has given up on it
INJECTIONS = (UNSEEDED, OVERLAPPING_SHARDS, STRAGGLER, MISSING_RANK)
FAULTY_RANK = 1  # the rank that misbehaves in STRAGGLER and MISSING_RANK
@dataclass(frozen=True)
class DoctorOptions:
    """What the diagnostic run does."""

    world_size: int = 2  # ranks to spawn (under torchrun, torchrun's world size is used)
    device_type: str = "cpu"  # "cpu" or "cuda"
    backend: str | None = None  # None: nccl on cuda, gloo on cpu
    model_size: str = "tiny"  # key of model.MODEL_SIZES: the step's model and the bucket's s
    batch_size: int = 4  # sequences per rank per step
    dataset_len: int = 64  # samples in the synthetic dataset the sampler shards
    warmup_steps: int = 1  # untimed steps (the first pays allocation and bucket set-up)
    timed_steps: int = 5  # steps whose compute time is compared across ranks
    bucket_size_mb: float | None = 25.0  # BucketedDDP's cap in the step (MB = 2**20 bytes)
    straggler_factor: float = 1.5  # flag a rank this many times slower than the others' median
    straggler_min_excess_s: float = 0.02  # ... and at least this much slower (timer noise)
    checkin_timeout_s: float = 15.0  # how long rank 0 waits for the others to check in
    calibration_bytes: tuple[int, ...] = (4 * KB, 64 * KB, 512 * KB, 4 * MB)  # payloads to time
    calibration_iters: int = 10  # timed all-reduces per payload (after one warm-up)
    straggler_delay_s: float = 0.3  # how long the injected straggler sleeps per step
    inject: str | None = None  # one of INJECTIONS, or None for the healthy run
    seed: int = 0  # model and data seed (every rank alike unless UNSEEDED is injected)
    timeout_s: float = 120.0  # process-group timeout: bounds every collective


class ParameterChecksum(NamedTuple):
    """What one rank knows about one parameter, small enough to gather for every parameter."""

    bit_sum: int  # sum of the raw bit patterns as integers: exact and independent of order
    value_sum: float  # float64 sums, for reading; their rounding may depend on reduction order
    square_sum: float


@dataclass
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


@dataclass
class DoctorReport:
    """Everything one scenario found; the same on every rank."""

    inject: str | None
    model_size: str
    parameter_count: int
    gradient_bytes: int
    largest_param_bytes: int
    ranks: list[RankInfo]
    calibration: list[dict[str, Any]]  # per payload: bytes, median slowest-rank seconds, correct
    allreduce_o_s: float | None  # fitted per-call cost (None if no fit)
    allreduce_w_bytes_per_s: float | None  # fitted bandwidth (algbw)
    fit_r2: float | None
    suggested_bucket_bytes: float | None
    findings: list[str] = field(default_factory=list)  # what is wrong; non-empty: exit 1
    notes: list[str] = field(default_factory=list)  # worth knowing, not wrong

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


# ---------------------------------------------------------------------------------------------
# What each rank measures


def parameter_checksums(module: nn.Module) -> list[ParameterChecksum]:
    """One :class:`ParameterChecksum` per parameter of ``module``, in ``named_parameters`` order."""
    int_of_size = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    out = []
    with torch.no_grad():
        for p in module.parameters():
            bits = p.detach().contiguous().view(int_of_size[p.element_size()])
            values = p.detach().double()
            out.append(
                ParameterChecksum(
                    int(bits.sum(dtype=torch.int64)),
                    float(values.sum()),
                    float((values * values).sum()),
                )
            )
    return out


def _connect_store(ctx: RankContext, timeout_s: float) -> dist.Store:
    """A client of the job's rendezvous store (rank 0's, or torchrun's), under a fresh prefix."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    # A fresh prefix per run: torchrun's store outlives one run of the doctor.
    box = [uuid.uuid4().hex if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return dist.PrefixStore(f"cs336-doctor/{box[0]}", store)


def _check_in(
    ctx: RankContext, store: dist.Store, options: DoctorOptions, inject: str | None
) -> list[float | None]:
    """Each rank sets its key; rank 0 times the arrivals. Returns arrivals (rank 0) or []."""
    if ctx.rank == FAULTY_RANK and inject == MISSING_RANK:
        # Late on purpose, and deterministically so: arrive only once rank 0 has given up.
        store.wait(["verdict"])
    if not ctx.is_main:
        store.set(f"rank{ctx.rank}", str(ctx.rank))
        store.add("arrived", 1)
        return []
    start = time.monotonic()
    arrivals: list[float | None] = [0.0] + [None] * (ctx.world_size - 1)
    pending, seen = set(range(1, ctx.world_size)), 0
    while True:
        now = time.monotonic() - start
        count = store.add("arrived", 0)  # one round trip, however many ranks there are
        if count > seen:
            seen = count
            for r in sorted(pending):
                if store.check([f"rank{r}"]):
                    arrivals[r] = now
                    pending.discard(r)
        if not pending:
            break
        if now > options.checkin_timeout_s and not store.check(["verdict"]):
            store.set("verdict", json.dumps(sorted(pending)))
            print(
                f"doctor: {ranks_text(sorted(pending))} did not check in within "
                f"{options.checkin_timeout_s:g} s; waiting up to {options.timeout_s:g} s more",
                file=sys.stderr,
                flush=True,
            )
        if now > options.checkin_timeout_s + options.timeout_s:
            raise TimeoutError(f"{ranks_text(sorted(pending))} never checked in")
        time.sleep(0.01)
    if not store.check(["verdict"]):
        store.set("verdict", "[]")
    return arrivals


def _load_per_core() -> float | None:
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return None


def _sync_stream(device: torch.device) -> None:
    # Only the compute stream: waiting for NCCL's streams would count communication as compute.
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _train_steps(
    ctx: RankContext,
    model: nn.Module,
    data: torch.Tensor,
    indices: list[int],
    options: DoctorOptions,
    inject: str | None,
) -> tuple[float, float, float, float]:
    """Median step, median and least compute, and median wait seconds over the timed steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    finish = getattr(model, "finish_gradient_synchronization", None)
    steps, computes, waits = [], [], []
    for step in range(options.warmup_steps + options.timed_steps):
        rows = [indices[(step * options.batch_size + k) % len(indices)] for k in range(options.batch_size)]
        batch = data[rows].to(ctx.device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if inject == STRAGGLER and ctx.rank == FAULTY_RANK:
            time.sleep(options.straggler_delay_s)
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        _sync_stream(ctx.device)
        computed = time.perf_counter()
        if finish is not None:
            finish()
            _sync_stream(ctx.device)
        waited = time.perf_counter()
        optimizer.step()
        _sync_stream(ctx.device)
        if step >= options.warmup_steps:
            steps.append(time.perf_counter() - start)
            computes.append(computed - start)
            waits.append(waited - computed)
    return statistics.median(steps), statistics.median(computes), min(computes), statistics.median(waits)


def _calibrate(ctx: RankContext, options: DoctorOptions) -> list[dict[str, Any]]:
    rows = []
    for size in options.calibration_bytes:
        times, correct = time_payload(ctx, size, 1, options.calibration_iters)
        rows.append({"payload_bytes": size, "median_s": statistics.median(times), "correct": correct})
    return rows


def _scenario_rank(
    ctx: RankContext, store: dist.Store, options: DoctorOptions, inject: str | None
) -> dict[str, Any]:
    """One scenario on this rank: everything it measured, to be gathered."""
    arrivals = _check_in(ctx, store, options, inject)
    config = model_config(options.model_size)
    g = torch.Generator().manual_seed(options.seed)
    data = torch.randint(0, config.vocab_size, (options.dataset_len, config.context_length + 1), generator=g)
    sampler_rank = 0 if inject == OVERLAPPING_SHARDS else ctx.rank
    sampler = DistributedSampler(
        range(options.dataset_len), num_replicas=ctx.world_size, rank=sampler_rank, shuffle=True, seed=options.seed
    )
    indices = list(sampler)

    torch.manual_seed(options.seed + (ctx.rank if inject == UNSEEDED else 0))
    module = TransformerLM(config).to(ctx.device)
    checksums = {BEFORE_BROADCAST: parameter_checksums(module)}
    model: nn.Module = module
    if inject != UNSEEDED:
        # The model's only buffers are RoPE tables computed from its config, equal on every rank;
        # broadcasting them at each forward would make fast ranks wait for a straggler inside
        # forward, where the compute time that finds stragglers is measured.
        model = BucketedDDP(module, bucket_size_mb=options.bucket_size_mb, broadcast_buffers=False)
        checksums[AFTER_WRAPPING] = parameter_checksums(module)
    step_s, compute_s, fastest_s, wait_s = _train_steps(ctx, model, data, indices, options, inject)
    checksums[AFTER_TRAINING] = parameter_checksums(module)
    info = RankInfo(
        ctx.rank, ctx.local_rank, ctx.world_size, ctx.backend, str(ctx.device), socket.gethostname(),
        os.getpid(), None, len(indices), step_s, compute_s, fastest_s, wait_s, _load_per_core(),
    )
    return {
        "info": info,
        "arrivals": arrivals,
        "indices": indices,
        "checksums": checksums,
        "names": [name for name, _ in module.named_parameters()],
        "sizes": [p.numel() * p.element_size() for p in module.parameters() if p.requires_grad],
        "parameter_count": count_parameters(module),
        "calibration": _calibrate(ctx, options),
    }


def doctor_rank(ctx: RankContext, options: DoctorOptions, injects: Sequence[str | None]) -> list[DoctorReport]:
    """Every scenario of ``injects`` in turn on this rank; returns one report per scenario.

    Every rank gathers every rank's measurements, so every rank builds the same reports.
    """
    if ctx.world_size <= FAULTY_RANK and any(i in (STRAGGLER, MISSING_RANK) for i in injects):
        raise ValueError(f"injecting a fault on rank {FAULTY_RANK} needs world size > {FAULTY_RANK}")
    ctx.share_cpu_threads()
    store = _connect_store(ctx, options.timeout_s)
    reports = []
    for index, inject in enumerate(injects):
        local = _scenario_rank(ctx, dist.PrefixStore(f"scenario{index}", store), options, inject)
        gathered: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(gathered, local)
        reports.append(build_report(gathered, options, inject))
    return reports


# ---------------------------------------------------------------------------------------------
# From gathered measurements to a report


def build_report(gathered: list[dict[str, Any]], options: DoctorOptions, inject: str | None) -> DoctorReport:
    """The report of one scenario from every rank's measurements (rank 0's first). Pure."""
    main = gathered[0]
    ranks = [replace(g["info"], checkin_s=arrival) for g, arrival in zip(gathered, main["arrivals"])]
    n = len(ranks)
    findings = find_missing_ranks([r.checkin_s for r in ranks], options.checkin_timeout_s)
    findings += find_shard_problems([g["indices"] for g in gathered], options.dataset_len)
    for stage in STAGE_CAUSES:
        if stage not in main["checksums"]:
            continue
        mismatches = find_parameter_mismatches([g["checksums"][stage] for g in gathered], main["names"], stage)
        if mismatches:
            findings += mismatches  # later stages inherit the difference: report the first only
            break
    findings += find_stragglers(
        [r.fastest_compute_s for r in ranks],
        options.straggler_factor,
        options.straggler_min_excess_s,
        [r.load_per_core for r in ranks],
    )

    notes = []
    padding = (-options.dataset_len) % n
    if padding:
        notes.append(
            f"DistributedSampler repeats {padding} of {options.dataset_len} samples so that "
            f"{n} ranks get equal shards (drop_last=False); metrics over an epoch count them twice"
        )
    busy = {r.hostname: r.load_per_core for r in ranks if r.load_per_core is not None and r.load_per_core > 1}
    for host, load in busy.items():
        notes.append(
            f"host {host} is oversubscribed (load average {load:.1f} per core): other processes "
            "compete for its CPUs, so its times are noisy"
        )
    calibration = main["calibration"]
    wrong = [row["payload_bytes"] for row in calibration if not row["correct"]]
    if wrong:
        findings.append(f"all-reduce returned wrong sums for payloads of {wrong} bytes: the backend is broken")
    sizes = main["sizes"]
    s, largest = sum(sizes), max(sizes)
    o = w = r2 = bucket = None
    if n < 2:
        notes.append("world size 1: nothing to compare, and no all-reduce cost to fit")
    else:
        try:
            o, w, r2 = fit_latency_bandwidth(
                [row["payload_bytes"] for row in calibration], [row["median_s"] for row in calibration]
            )
        except ValueError as e:
            notes.append(f"could not fit the all-reduce cost: {e}")
    if o is not None and w is not None:
        if o < 0:
            notes.append(
                f"fitted per-call cost o = {o * 1e6:.1f} us is below what the timings resolve; taken as 0"
            )
        bucket = optimal_bucket_bytes(s, w, max(o, 0.0), largest)
    return DoctorReport(
        inject, options.model_size, main["parameter_count"], s, largest, ranks, calibration,
        o, w, r2, bucket, findings, notes,
    )


def validate_options(options: DoctorOptions) -> None:
    """ValueError for options that cannot work, before any rank starts."""
    if options.inject is not None and options.inject not in INJECTIONS:
        raise ValueError(f"inject must be one of {INJECTIONS} or None, got {options.inject!r}")
    if options.model_size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {options.model_size!r}; known: {', '.join(MODEL_SIZES)}")
    for name in ("world_size", "batch_size", "dataset_len", "timed_steps", "calibration_iters"):
        if getattr(options, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(options, name)}")
    if options.warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {options.warmup_steps}")
    if not options.straggler_factor > 1:
        raise ValueError(f"straggler_factor must be > 1, got {options.straggler_factor}")
    if not 0 < options.checkin_timeout_s < options.timeout_s:
        raise ValueError(
            f"checkin_timeout_s must be > 0 and below the process-group timeout "
            f"({options.timeout_s:g} s), got {options.checkin_timeout_s}"
        )
    if len(set(options.calibration_bytes)) < 2 or any(b <= 0 or b % 4 for b in options.calibration_bytes):
        raise ValueError(
            "calibration needs >= 2 distinct payloads, positive multiples of 4 bytes; "
            f"got {options.calibration_bytes}"
        )


def run_doctor_scenarios(options: DoctorOptions, injects: Sequence[str | None]) -> list[DoctorReport]:
    """One launch, one report per entry of ``injects`` (None: healthy). Starting ranks costs
    seconds; the scenarios share one process group."""
    for inject in injects:
        validate_options(DoctorOptions(**{**asdict(options), "inject": inject}))
    under_launcher = running_under_launcher()
    world_size = int(os.environ["WORLD_SIZE"]) if under_launcher else options.world_size
    if world_size <= FAULTY_RANK and any(i in (STRAGGLER, MISSING_RANK) for i in injects):
        raise ValueError(
            f"injecting a fault on rank {FAULTY_RANK} needs world size > {FAULTY_RANK}, got {world_size}"
        )
    ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_launcher else world_size
    check_devices(options.device_type, options.backend, ranks_on_node)
    results = run_ranks(
        doctor_rank,
        options.world_size,
        args=(options, list(injects)),
        backend=options.backend,
        device_type=options.device_type,
        timeout_s=options.timeout_s,
    )
    return results[0]


def run_doctor(options: DoctorOptions) -> DoctorReport:
    """The diagnostic run with ``options.inject`` (spawned ranks, or this rank under torchrun)."""
    return run_doctor_scenarios(options, [options.inject])[0]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def format_report(report: DoctorReport) -> str:
    """The per-rank table, the calibration, and the findings (or an OK summary)."""
    first = report.ranks[0]
    lines = [
        f"DDP doctor: {first.world_size} ranks, backend {first.backend}, model {report.model_size} "
        f"({report.parameter_count / 1e6:.2f}M parameters, {report.gradient_bytes / MB:.2f} MB of gradients)"
        + (f", injected fault: {report.inject}" if report.inject else ""),
        f"{'rank':>4} {'local':>5} {'host':<16} {'device':<7} {'pid':>7} {'check-in s':>10} "
        f"{'samples':>7} {'step ms':>8} {'compute ms':>10} {'fastest':>7} {'wait ms':>8}",
    ]
    for r in report.ranks:
        checkin = "never" if r.checkin_s is None else f"{r.checkin_s:.2f}"
        lines.append(
            f"{r.rank:>4} {r.local_rank:>5} {r.hostname[:16]:<16} {r.device:<7} {r.pid:>7} {checkin:>10} "
            f"{r.samples:>7} {_ms(r.step_s):>8} {_ms(r.compute_s):>10} {_ms(r.fastest_compute_s):>7} "
            f"{_ms(r.wait_s):>8}"
        )
    lines.append(
        "(compute: forward + backward, median and fastest step; wait: in "
        "finish_gradient_synchronization, for the other ranks' gradients)"
    )
    timings = ", ".join(
        f"{row['payload_bytes'] / KB:g} KB {_ms(row['median_s'])} ms" for row in report.calibration
    )
    lines.append(f"all-reduce (slowest rank, median): {timings}")
    if report.allreduce_o_s is not None and report.allreduce_w_bytes_per_s is not None:
        lines.append(
            f"fit time = o + bytes / w: o = {report.allreduce_o_s * 1e6:.1f} us, "
            f"w = {report.allreduce_w_bytes_per_s / 1e9:.3f} GB/s (r2 {report.fit_r2:.3f})"
        )
    if report.suggested_bucket_bytes is not None:
        lines.append(
            f"suggested bucket: {report.suggested_bucket_bytes / MB:.2f} MB = sqrt(s w o) with "
            f"s = {report.gradient_bytes / MB:.2f} MB, clamped to [largest parameter "
            f"{report.largest_param_bytes / MB:.2f} MB, s] (BucketedDDP(bucket_size_mb=...))"
        )
    lines += [f"note: {note}" for note in report.notes]
    if report.ok:
        lines.append(
            f"OK: all {first.world_size} ranks checked in; shards disjoint and cover the data; "
            "parameters agree after wrapping and after training; no straggler"
        )
    else:
        lines.append(f"FOUND {len(report.findings)} problem{'s' if len(report.findings) > 1 else ''}:")
        lines += [f"  {i}. {finding}" for i, finding in enumerate(report.findings, start=1)]
    return "\n".join(lines)


def exit_status(report: DoctorReport) -> int:
    """0 when healthy, 1 when something was found."""
    return 0 if report.ok else 1


def write_report(path: str | os.PathLike, report: DoctorReport) -> None:
    with open(path, "w") as f:
        json.dump(report.to_dict(), f, indent=2, sort_keys=True)
        f.write("\n")
