"""The doctor's ranks: each checks in, trains a few steps, checksums its parameters and times
all-reduces; every rank gathers every rank's measurements and builds the same reports.

:func:`run_doctor_scenarios` runs them (spawned here, or this process as one rank under
torchrun or SLURM); one launch serves several scenarios, since starting ranks costs seconds.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

from cs336_basics.model import TransformerLM, count_parameters
from cs336_systems.comm.timing import BackwardClock, sync_compute_stream
from cs336_systems.ddp import BucketedDDP
from cs336_systems.ddp.auto_bucket import calibrate_allreduce
from cs336_systems.doctor.diagnose import build_report
from cs336_systems.doctor.in_job import replica_checksums
from cs336_systems.doctor.findings import (
    AFTER_TRAINING,
    AFTER_WRAPPING,
    BEFORE_BROADCAST,
    ParameterChecksum,
    ranks_text,
)
from cs336_systems.doctor.report import DoctorReport, RankInfo
from cs336_systems.doctor.setting import (
    FAULTY_RANK,
    MISSING_RANK,
    OVERLAPPING_SHARDS,
    STRAGGLER,
    UNSEEDED,
    DoctorSetting,
)
from cs336_systems.launch import RankContext, run_ranks


@dataclass(frozen=True)
class DoctorRun:
    """A finished run, as one process sees it."""

    reports: list[DoctorReport]  # one per scenario, in the order asked for
    rank: int  # this process's rank (0 when the ranks were spawned here): rank 0 speaks
    shared_gpu: bool  # ranks of a node took turns on one GPU


def parameter_checksums(module: nn.Module) -> list[ParameterChecksum]:
    """One :class:`ParameterChecksum` per parameter of ``module``, in ``named_parameters`` order."""
    return replica_checksums(list(module.parameters()))


def _connect_store(ctx: RankContext, timeout_s: float) -> dist.Store:
    """A client of the job's rendezvous store (rank 0's, or torchrun's), under a fresh prefix."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    # A fresh prefix per run: torchrun's store outlives one run of the doctor.
    box = [uuid.uuid4().hex if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return dist.PrefixStore(f"cs336-doctor/{box[0]}", store)


def _check_in(ctx: RankContext, store: dist.Store, setting: DoctorSetting, inject: str | None) -> list[float | None]:
    """Each rank sets its key; rank 0 times the arrivals. Returns arrivals (rank 0) or [].

    A store key, unlike a collective, says *which* rank is missing.
    """
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
        if now > setting.checkin_timeout_s and not store.check(["verdict"]):
            store.set("verdict", json.dumps(sorted(pending)))
            print(f"doctor: {ranks_text(sorted(pending))} did not check in within {setting.checkin_timeout_s:g} s; "
                  f"waiting up to {setting.timeout_s:g} s more", file=sys.stderr, flush=True)
        if now > setting.checkin_timeout_s + setting.timeout_s:
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


def _train_steps(
    ctx: RankContext, model: nn.Module, data: torch.Tensor, indices: list[int], setting: DoctorSetting,
    inject: str | None,
) -> tuple[float, float, float, float]:
    """Median step, median and least compute, and median wait seconds over the timed steps.

    Only the compute stream is waited for before each clock read: waiting for NCCL's streams
    would count communication as compute. The wrapper reduces as backward ends, so compute ends
    where :class:`BackwardClock` marks it, and the wait runs from there to the end of backward.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    clock = BackwardClock(ctx.device)
    rows_per_step = setting.global_batch // ctx.world_size
    steps, computes, waits = [], [], []
    for step in range(setting.warmup_steps + setting.steps):
        rows = [indices[(step * rows_per_step + k) % len(indices)] for k in range(rows_per_step)]
        batch = data[rows].to(ctx.device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if inject == STRAGGLER and ctx.rank == FAULTY_RANK:
            time.sleep(setting.straggler_delay_s)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        clock.watch(loss)
        loss.backward()
        sync_compute_stream(ctx.device)
        waited = time.perf_counter()
        computed = clock.compute_end if clock.compute_end is not None else waited
        optimizer.step()
        sync_compute_stream(ctx.device)
        if step >= setting.warmup_steps:
            steps.append(time.perf_counter() - start)
            computes.append(computed - start)
            waits.append(waited - computed)
    return statistics.median(steps), statistics.median(computes), min(computes), statistics.median(waits)


def _scenario_rank(ctx: RankContext, store: dist.Store, setting: DoctorSetting, inject: str | None) -> dict[str, Any]:
    """One scenario on this rank: everything it measured, to be gathered."""
    arrivals = _check_in(ctx, store, setting, inject)
    config = setting.model_config
    g = torch.Generator().manual_seed(setting.seed)
    data = torch.randint(0, config.vocab_size, (setting.dataset_len, config.context_length + 1), generator=g)
    sampler_rank = 0 if inject == OVERLAPPING_SHARDS else ctx.rank
    sampler = DistributedSampler(range(setting.dataset_len), num_replicas=ctx.world_size, rank=sampler_rank,
                                 shuffle=True, seed=setting.seed)
    indices = list(sampler)

    torch.manual_seed(setting.seed + (ctx.rank if inject == UNSEEDED else 0))
    module = TransformerLM(config).to(ctx.device)
    checksums = {BEFORE_BROADCAST: parameter_checksums(module)}
    model: nn.Module = module
    if inject != UNSEEDED:
        # The model's only buffers are RoPE tables computed from its config, equal on every rank;
        # broadcasting them at each forward would make fast ranks wait for a straggler inside
        # forward, where the compute time that finds stragglers is measured.
        model = BucketedDDP(module, bucket_size_mb=setting.bucket_size_mb, broadcast_buffers=False)
        checksums[AFTER_WRAPPING] = parameter_checksums(module)
    step_s, compute_s, fastest_s, wait_s = _train_steps(ctx, model, data, indices, setting, inject)
    checksums[AFTER_TRAINING] = parameter_checksums(module)
    info = RankInfo(
        ctx.rank, ctx.local_rank, ctx.world_size, ctx.backend, str(ctx.device), socket.gethostname(), os.getpid(),
        None, len(indices), step_s, compute_s, fastest_s, wait_s, _load_per_core(),
    )
    return {
        "info": info,
        "arrivals": arrivals,
        "indices": indices,
        "checksums": checksums,
        "names": [name for name, _ in module.named_parameters()],
        "sizes": [p.numel() * p.element_size() for p in module.parameters() if p.requires_grad],
        "parameter_count": count_parameters(module),
    }


def doctor_rank(ctx: RankContext, setting: DoctorSetting, injects: Sequence[str | None]) -> DoctorRun:
    """Every scenario of ``injects`` in turn on this rank; every rank builds the same reports."""
    ctx.share_cpu_threads()
    store = _connect_store(ctx, setting.timeout_s)
    reports = []
    for index, inject in enumerate(injects):
        local = _scenario_rank(ctx, dist.PrefixStore(f"scenario{index}", store), setting, inject)
        gathered: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(gathered, local)
        # Every rank gets the same (slowest-rank) calibration; one rank alone has nothing to time.
        calibration = None if ctx.world_size < 2 else calibrate_allreduce(
            ctx.device, None, setting.calibration_bytes, setting.calibration_iters)
        reports.append(build_report(gathered, setting, inject, calibration))
    return DoctorRun(reports, ctx.rank, ctx.shared_gpu)


def run_doctor_scenarios(setting: DoctorSetting, injects: Sequence[str | None]) -> DoctorRun:
    """One launch, one report per entry of ``injects`` (None: healthy). Each scenario's setting
    is validated (ValueError) before any rank starts."""
    for inject in injects:
        replace(setting, inject=inject).validate()
    return run_ranks(
        doctor_rank, setting.world_size, (setting, list(injects)),
        backend=setting.backend, device_type=setting.device, timeout_s=setting.timeout_s,
    )[0]


def run_doctor(setting: DoctorSetting) -> DoctorRun:
    """The diagnostic run with ``setting.inject`` (spawned ranks, or this rank under torchrun)."""
    return run_doctor_scenarios(setting, [setting.inject])
