"""Profiler timelines of DDP training steps (problem 5b): does communication overlap backward?

For each variant the ranks train a few steps under ``torch.profiler``; rank 0 saves the Chrome
trace and reduces it to step timelines (trace.py). Phases of each step are labelled with
``torch.profiler.record_function`` ranges ("forward", "backward",
"finish_gradient_synchronization", "optimizer_step" inside "train_step"), so they are visible
in a trace viewer too.

The *overlap fraction* of a step is the share of its communication time (union of the
intervals, so concurrent collectives count once) that lies inside the backward range. Naive
DDP all-reduces only after backward returns, so its fraction is 0; per-parameter DDP starts
each all-reduce from a gradient hook during backward, so part of its communication hides
under the backward of earlier layers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from cs336_systems.bench.profile.record import ProfileRecord
from cs336_systems.bench.profile.setting import ProfileSetting
from cs336_systems.bench.profile.trace import STEP_RANGE, extract_step_timelines, save_trace, trace_names
from cs336_systems.bench.workload import Workload, build_workload
from cs336_systems.comm.timing import sync_device
from cs336_systems.ddp import VARIANTS, DataParallel
from cs336_systems.launch import RankContext, run_ranks

RANK_TIMEOUT_S = 600
RUN_TIMEOUT_S = 1800


@dataclass(frozen=True)
class ProfileRun:
    """What rank 0 brings back."""

    records: list[ProfileRecord]  # one per variant, in the order profiled
    world_size: int
    shared_gpu: bool
    threads_per_rank: int | None = None  # torch's intra-op threads on each rank
    ranks_on_node: int | None = None  # ranks sharing this machine's cores (and GPUs)

    @property
    def notes(self) -> dict:
        """Run-level figures for the results file (the writeup states the setting from them)."""
        found = {"threads_per_rank": self.threads_per_rank, "ranks_on_node": self.ranks_on_node}
        return {k: v for k, v in found.items() if v is not None}


class _BackwardThenFinish:
    """The "backward" range, switched to "finish_gradient_synchronization" when backward's own
    computation ends. The wrappers reduce inside ``backward()``, after its last node
    (ddp/base.py); that wait is the finish phase, as when the call came after backward. The
    loss's gradient hook queues the switch first, so it runs before the wrappers' reduction
    (autograd runs end-of-backward callbacks in order). A range ends on the thread that began it:
    where autograd runs the callback on another thread (a GPU's), the switch waits until
    ``backward()`` returns."""

    def __init__(self, loss: torch.Tensor):
        self.thread = threading.get_ident()
        self.current = record_function("backward")
        loss.register_hook(lambda grad: torch.autograd.Variable._execution_engine.queue_callback(self.switch))

    def __enter__(self) -> _BackwardThenFinish:
        self.current.__enter__()
        return self

    def switch(self) -> None:
        if threading.get_ident() == self.thread and self.current.name == "backward":
            self.current.__exit__(None, None, None)
            self.current = record_function("finish_gradient_synchronization")
            self.current.__enter__()

    def __exit__(self, *exc) -> None:
        self.current.__exit__(*exc)


def _train_step(wrapper: DataParallel, optimizer: torch.optim.Optimizer, work: Workload, device: torch.device) -> None:
    with record_function(STEP_RANGE):
        optimizer.zero_grad(set_to_none=True)
        with record_function("forward"):
            logits = wrapper(work.tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), work.targets.flatten())
        with _BackwardThenFinish(loss) as phase:
            loss.backward()
            phase.switch()  # if autograd ran the callback on another thread
            wrapper.finish_gradient_synchronization()  # nothing left to do: kept for any wrapper
        with record_function("optimizer_step"):
            optimizer.step()
        # Keeps each step's kernels inside its CPU range, so steps can be told apart.
        sync_device(device)


def _profile_rank(ctx: RankContext, setting: ProfileSetting, trace_dir: str) -> ProfileRun | None:
    work = build_workload(ctx, setting)
    activities = [ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    records = []
    for name in setting.variants:
        wrapper = VARIANTS[name].wrap(work.module)
        optimizer = torch.optim.AdamW(work.module.parameters(), lr=1e-4)
        for _ in range(setting.warmup_steps):
            _train_step(wrapper, optimizer, work, ctx.device)
        dist.barrier()  # start the profiled steps together
        with profile(activities=activities) as prof:
            for _ in range(setting.steps):
                _train_step(wrapper, optimizer, work, ctx.device)
        wrapper.detach()
        if ctx.rank != 0:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            text = raw.read_text()
        trace_path = save_trace(text, Path(trace_dir), name)
        timelines = extract_step_timelines(json.loads(text), ctx.backend)
        records.append(ProfileRecord.from_timelines(name, trace_path.name, timelines))
    if ctx.rank != 0:
        return None
    return ProfileRun(records, ctx.world_size, ctx.shared_gpu, torch.get_num_threads(), ctx.local_world_size)


def move_traces(records: list[ProfileRecord], source: Path, folder: Path) -> None:
    """Each record's trace from ``source`` into ``folder``, in place of its variant's earlier trace
    (either compression); a record whose trace ``source`` does not hold leaves the folder's as it is."""
    for record in records:
        if not (Path(source) / record.trace).is_file():
            continue
        for stale in trace_names(record.variant):
            (folder / stale).unlink(missing_ok=True)
        os.replace(Path(source) / record.trace, Path(folder) / record.trace)


def profile_into(setting: ProfileSetting, folder: Path) -> ProfileRun | None:
    """Profile every variant in one process group; rank 0's traces end up in ``folder``.

    The traces are written to a hidden staging folder beside and moved into ``folder`` only when
    every variant is done, so an interrupted run leaves the previous traces in place. Returns
    rank 0's run (None on other ranks, which happens only under torchrun/SLURM, where this
    process is one rank).
    """
    setting.validate()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".traces-", dir=folder))
    try:
        results = run_ranks(
            _profile_rank, setting.world_size, args=(setting, str(staging)), backend=setting.backend,
            device_type=setting.device, timeout_s=RANK_TIMEOUT_S, join_timeout_s=RUN_TIMEOUT_S,
        )
        run = results[0]
        if run is not None:
            move_traces(run.records, staging, folder)
        return run
    finally:
        shutil.rmtree(staging, ignore_errors=True)
