"""Profiler timelines of DDP training steps (problem 5b): does communication overlap backward?

For each variant (naive, per-parameter) the ranks train a few steps under
``torch.profiler``; rank 0 saves the Chrome trace (open it in https://ui.perfetto.dev or
chrome://tracing), and :func:`extract_step_timelines` reduces it to two lanes on one clock:

* **backward compute**: on CPU, the autograd engine's node evaluations
  (``autograd::engine::evaluate_function: ...``) inside the ``backward`` range; on GPU, the
  kernels launched during that range (matched by their launch's ``correlation`` id);
* **communication**: the all-reduces themselves, read from what the process group's backend
  really does (chosen by backend, not by device):

  - gloo records each collective as a ``gloo:all_reduce`` event on its worker thread, from when
    the worker picks the work up until it completes (waiting for slower peers included);
    ``c10d::allreduce_`` on the calling thread is only the enqueue and is not counted. On CUDA
    tensors gloo reduces in host memory: the enqueue copies each tensor to the host and the
    worker copies the result back, so those copies (``gpu_memcpy`` events launched inside the
    enqueue or the worker's event) are communication too;
  - NCCL runs ``ncclDevKernel_AllReduce_...`` kernels on its own stream of the GPU timeline.

The *overlap fraction* of a step is the share of its communication time (union of the
intervals, so concurrent collectives count once) that lies inside the backward range. Naive
DDP all-reduces only after backward returns, so its fraction is 0; per-parameter DDP starts
each all-reduce from a gradient hook during backward, so part of its communication hides
under the backward of earlier layers.

Phases of each step are labelled with ``torch.profiler.record_function`` ranges ("forward",
"backward", "finish_gradient_synchronization", "optimizer_step" inside "train_step"), so they
are visible in the trace viewer too.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from cs336_systems.ddp import DataParallel, NaiveDDP, PerParameterDDP
from cs336_systems.equivalence import shard_rows
from cs336_systems.model import TransformerLM, model_config
from cs336_systems.launch import RankContext, run_ranks

VARIANTS: dict[str, type[DataParallel]] = {"naive": NaiveDDP, "per-parameter": PerParameterDDP}
STEP_RANGE = "train_step"
PHASES = ("forward", "backward", "finish_gradient_synchronization", "optimizer_step")
GLOO_ALL_REDUCE = "gloo:all_reduce"
ENQUEUE_ALL_REDUCE = "c10d::allreduce_"
BACKENDS = ("gloo", "nccl")
AUTOGRAD_NODE_PREFIX = "autograd::engine::evaluate_function:"
# Chrome traces of a bigger model run to tens of MB; past this size we store them gzipped
# (Perfetto and chrome://tracing open .json.gz directly).
MAX_PLAIN_TRACE_BYTES = 5 * 2**20

Interval = tuple[float, float]  # (start, end) in microseconds since the step's start


@dataclass(frozen=True)
class ProfileSetting:
    """What to profile."""

    model_size: str = "cpu-small"  # key of model.MODEL_SIZES
    context_length: int = 128  # tokens per sequence
    global_batch: int = 4  # sequences per step over all ranks
    world_size: int = 2  # ranks
    device_type: str = "cpu"  # "cpu" or "cuda"
    backend: str | None = None  # None: nccl on cuda, gloo on cpu
    variants: tuple[str, ...] = ("naive", "per-parameter")  # keys of VARIANTS
    warmup_steps: int = 2  # unprofiled steps first (per-parameter DDP settles its order in step 1)
    steps: int = 2  # profiled steps; the timeline shows the last
    seed: int = 0
    out_dir: str = "."  # where rank 0 writes trace_<variant>.json[.gz]

    def validate(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ValueError(
                f"variants must be a non-empty subset of {sorted(VARIANTS)}, got {list(self.variants)}"
            )
        if self.steps < 1 or self.warmup_steps < 0:
            raise ValueError(
                f"need steps >= 1 and warmup_steps >= 0, got {self.steps} and {self.warmup_steps}"
            )
        shard_rows(self.global_batch, 0, self.world_size)
        model_config(self.model_size, self.context_length)


# -- intervals -----------------------------------------------------------------------------------


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def total_length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in merge_intervals(intervals))


def length_inside(intervals: Iterable[Interval], window: Interval) -> float:
    """How much of the union of ``intervals`` lies inside ``window``."""
    low, high = window
    return sum(max(0.0, min(b, high) - max(a, low)) for a, b in merge_intervals(intervals))


@dataclass(frozen=True)
class StepTimeline:
    """One training step of one rank, reduced to what the overlap question needs."""

    duration_us: float  # the "train_step" range
    phases: dict[str, Interval]  # record_function ranges of PHASES present in the step
    backward_compute: list[Interval]  # merged
    communication: list[Interval]  # merged all-reduce intervals
    n_comm_events: int  # all-reduce events (before merging)
    device_clock: bool  # True: compute is GPU kernels; False: CPU threads
    backend: str  # whose events make the communication lane: "gloo" or "nccl"

    @property
    def lanes_from(self) -> str:
        compute = "GPU kernels" if self.device_clock else "autograd nodes on the CPU"
        if self.backend == "nccl":
            return f"compute: {compute}; all-reduce: NCCL kernels"
        copies = " and their host-device copies" if self.device_clock else ""
        return f"compute: {compute}; all-reduce: gloo worker threads{copies}"

    @property
    def backward_range(self) -> Interval:
        """When backward computes: the span of its kernels on GPU (they run after their
        launches), the ``backward`` range on CPU."""
        if self.device_clock and self.backward_compute:
            return self.backward_compute[0][0], self.backward_compute[-1][1]
        return self.phases["backward"]

    @property
    def communication_us(self) -> float:
        return total_length(self.communication)

    @property
    def backward_us(self) -> float:
        start, end = self.backward_range
        return end - start

    @property
    def overlap_fraction(self) -> float:
        """Share of communication time inside the backward range (0 without communication)."""
        total = self.communication_us
        return length_inside(self.communication, self.backward_range) / total if total else 0.0


# -- trace extraction ----------------------------------------------------------------------------


def _span(event: dict) -> Interval:
    return float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))


def _is_cpu_annotation(event: dict, name: str) -> bool:
    # On GPU runs the profiler mirrors record_function ranges onto the GPU lane as
    # "gpu_user_annotation"; the CPU range is the one we want.
    return event.get("name") == name and event.get("cat") == "user_annotation"


def _is_nccl_all_reduce(event: dict) -> bool:
    name = event.get("name", "").lower()
    return event.get("cat") == "kernel" and "nccl" in name and "allreduce" in name


def _correlation(event: dict) -> Any:
    return event.get("args", {}).get("correlation")


def _launched_inside(runtime_calls: list[dict], spans: list[dict]) -> set:
    """Correlation ids of the runtime calls made inside one of ``spans`` on the same thread."""
    by_thread: dict[Any, list[Interval]] = {}
    for span in spans:
        by_thread.setdefault(span.get("tid"), []).append(_span(span))
    return {
        _correlation(call) for call in runtime_calls
        if any(a <= float(call["ts"]) <= b for a, b in by_thread.get(call.get("tid"), []))
    }


def extract_step_timelines(trace: dict[str, Any], backend: str) -> list[StepTimeline]:
    """One :class:`StepTimeline` per "train_step" range of a Chrome trace (``json.load``-ed)
    recorded with ``backend`` ("gloo" or "nccl").

    Raises ValueError for another backend, when the trace has no "train_step" range, or when a
    step lacks "backward".
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    steps = sorted(_span(e) for e in events if _is_cpu_annotation(e, STEP_RANGE))
    if not steps:
        raise ValueError(
            f"trace has no {STEP_RANGE!r} ranges: record each step inside "
            f"torch.profiler.record_function({STEP_RANGE!r})"
        )
    return [_extract_step(events, window, backend) for window in steps]


def _communication(inside: list[dict], backend: str) -> list[dict]:
    """The events that are all-reduce work of ``backend`` (see the module docstring)."""
    if backend == "nccl":
        return [e for e in inside if _is_nccl_all_reduce(e)]
    workers = [e for e in inside if e.get("name") == GLOO_ALL_REDUCE]
    enqueues = [e for e in inside if e.get("name") == ENQUEUE_ALL_REDUCE]
    runtime = [e for e in inside if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    staged = _launched_inside(runtime, workers + enqueues)
    copies = [e for e in inside if e.get("cat") == "gpu_memcpy" and _correlation(e) in staged]
    return workers + copies


def _extract_step(events: list[dict], window: Interval, backend: str) -> StepTimeline:
    s0, s1 = window
    inside = [e for e in events if s0 <= float(e["ts"]) <= s1]
    phases: dict[str, Interval] = {}
    for name in PHASES:
        spans = sorted(_span(e) for e in inside if _is_cpu_annotation(e, name))
        if spans:
            phases[name] = spans[0]
    if "backward" not in phases:
        raise ValueError(f"step at ts={s0:.0f} us has no 'backward' range; phases found: {sorted(phases)}")
    b0, b1 = phases["backward"]

    comm_events = _communication(inside, backend)
    kernels = [e for e in inside if e.get("cat") == "kernel"]
    device_clock = bool(kernels)
    if device_clock:
        launched_in_backward = {
            _correlation(e) for e in inside
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and b0 <= float(e["ts"]) <= b1
        }
        compute = [
            _span(e) for e in kernels
            if not _is_nccl_all_reduce(e) and _correlation(e) in launched_in_backward
        ]
    else:
        compute = [
            _span(e) for e in inside
            if e.get("name", "").startswith(AUTOGRAD_NODE_PREFIX) and b0 <= float(e["ts"]) <= b1
        ]

    def relative(intervals: Iterable[Interval]) -> list[Interval]:
        return [(a - s0, b - s0) for a, b in merge_intervals(intervals)]

    return StepTimeline(
        duration_us=s1 - s0,
        phases={name: (a - s0, b - s0) for name, (a, b) in phases.items()},
        backward_compute=relative(compute),
        communication=relative(_span(e) for e in comm_events),
        n_comm_events=sum(e.get("cat") != "gpu_memcpy" for e in comm_events),
        device_clock=device_clock,
        backend=backend,
    )


def load_trace(path: str | os.PathLike) -> dict[str, Any]:
    """A Chrome trace as saved by :func:`profile_ranks` (plain or gzipped JSON)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _save_trace(trace_text: str, out_dir: Path, variant: str) -> Path:
    plain = out_dir / f"trace_{variant}.json"
    zipped = plain.with_name(plain.name + ".gz")
    for stale in (plain, zipped):
        stale.unlink(missing_ok=True)
    if len(trace_text.encode()) <= MAX_PLAIN_TRACE_BYTES:
        plain.write_text(trace_text)
        return plain
    with open(zipped, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(trace_text.encode())
    return zipped


# -- the profiled run ----------------------------------------------------------------------------


@dataclass(frozen=True)
class VariantProfile:
    """What rank 0 brings back for one variant."""

    variant: str
    trace_path: str
    timelines: list[StepTimeline]  # one per profiled step

    @property
    def timeline(self) -> StepTimeline:
        """The last profiled step: the steadiest."""
        return self.timelines[-1]

    def record(self) -> dict[str, Any]:
        t = self.timeline
        return {
            "variant": self.variant,
            "overlap_fraction": t.overlap_fraction,
            "overlap_fraction_per_step": [s.overlap_fraction for s in self.timelines],
            "communication_s": t.communication_us * 1e-6,
            "backward_s": t.backward_us * 1e-6,
            "step_s": t.duration_us * 1e-6,
            "n_comm_events": t.n_comm_events,
            "phases_s": {name: [a * 1e-6, b * 1e-6] for name, (a, b) in t.phases.items()},
            "lanes_from": t.lanes_from,
            "trace": Path(self.trace_path).name,
        }


def _train_step(wrapper, optimizer, tokens, targets, device: torch.device) -> None:
    with record_function(STEP_RANGE):
        optimizer.zero_grad(set_to_none=True)
        with record_function("forward"):
            logits = wrapper(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        with record_function("backward"):
            loss.backward()
        with record_function("finish_gradient_synchronization"):
            wrapper.finish_gradient_synchronization()
        with record_function("optimizer_step"):
            optimizer.step()
        if device.type == "cuda":
            # Keeps each step's kernels inside its CPU range, so steps can be told apart.
            torch.cuda.synchronize(device)


def _profile_rank(ctx: RankContext, setting: ProfileSetting) -> list[VariantProfile] | None:
    ctx.share_cpu_threads()
    torch.manual_seed(setting.seed)
    config = model_config(setting.model_size, setting.context_length)
    module = TransformerLM(config).to(ctx.device)
    rows = shard_rows(setting.global_batch, ctx.rank, ctx.world_size)
    g = torch.Generator().manual_seed(setting.seed)
    data = torch.randint(0, config.vocab_size, (setting.global_batch, config.context_length + 1), generator=g)
    tokens, targets = data[rows, :-1].to(ctx.device), data[rows, 1:].to(ctx.device)
    activities = [ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    out_dir = Path(setting.out_dir)
    profiles = []
    for name in setting.variants:
        wrapper = VARIANTS[name](module)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        for _ in range(setting.warmup_steps):
            _train_step(wrapper, optimizer, tokens, targets, ctx.device)
        dist.barrier()  # start the profiled steps together
        with profile(activities=activities) as prof:
            for _ in range(setting.steps):
                _train_step(wrapper, optimizer, tokens, targets, ctx.device)
        wrapper.detach()
        if ctx.rank != 0:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            text = raw.read_text()
        trace_path = _save_trace(text, out_dir, name)
        timelines = extract_step_timelines(json.loads(text), ctx.backend)
        profiles.append(VariantProfile(name, str(trace_path), timelines))
    return profiles if ctx.rank == 0 else None


def profile_ranks(setting: ProfileSetting) -> list[VariantProfile] | None:
    """Profile every variant in one process group; rank 0's profiles (None on other ranks,
    which happens only under torchrun/SLURM, where this process is one rank)."""
    setting.validate()
    Path(setting.out_dir).mkdir(parents=True, exist_ok=True)
    results = run_ranks(
        _profile_rank,
        setting.world_size,
        args=(setting,),
        backend=setting.backend,
        device_type=setting.device_type,
        timeout_s=600,
        join_timeout_s=1800,
    )
    return results[0]


# -- figures -------------------------------------------------------------------------------------

PHASE_STYLE = {  # label and colour of each phase bar
    "forward": ("forward", "#9ecae1"),
    "backward": ("backward", "#a1d99b"),
    "finish_gradient_synchronization": ("finish_gradient_synchronization", "#fdae6b"),
    "optimizer_step": ("optimizer step", "#bcbddc"),
}
COMPUTE_COLOR, COMM_COLOR = "#31a354", "#de2d26"
LANES = ("communication\n(all-reduce)", "backward\ncompute", "phase")  # bottom to top


def _draw_timeline(ax, timeline: StepTimeline, title: str, bottom: bool) -> None:
    # matplotlib is imported where figures are drawn, so that ranks (which draw none) skip it.
    from matplotlib.patches import Patch

    ms = 1e-3
    b0, b1 = timeline.backward_range
    # The backward window across every lane: communication inside it is overlapped.
    ax.axvspan(b0 * ms, b1 * ms, color="0.92", zorder=0)
    def bars(intervals: Iterable[Interval]) -> list[tuple[float, float]]:
        return [(a * ms, (b - a) * ms) for a, b in intervals]

    for name, span in timeline.phases.items():
        ax.broken_barh(bars([span]), (1.6, 0.8), facecolor=PHASE_STYLE[name][1], edgecolor="0.3", linewidth=0.5)
    ax.broken_barh(bars(timeline.backward_compute), (0.65, 0.7), facecolor=COMPUTE_COLOR)
    ax.broken_barh(bars(timeline.communication), (-0.35, 0.7), facecolor=COMM_COLOR)
    ax.set_yticks(range(len(LANES)), LANES)
    ax.set_ylim(-0.6, 2.6)
    ax.set_title(
        f"{title}: {timeline.overlap_fraction:.0%} of all-reduce time inside backward "
        f"(all-reduce {timeline.communication_us * ms:.1f} ms in {timeline.n_comm_events} calls, "
        f"backward {timeline.backward_us * ms:.1f} ms)",
        fontsize=9,
        loc="left",
    )
    if bottom:  # one legend and axis label per figure, under the lowest timeline
        handles = [Patch(facecolor=color, label=label) for label, color in PHASE_STYLE.values()]
        handles.append(Patch(facecolor="0.92", label="backward window"))
        ax.legend(handles=handles, loc="upper right", bbox_to_anchor=(1.0, -0.22), fontsize=7, ncol=5,
                  frameon=False)
        ax.set_xlabel("time since the step started (ms)", fontsize=8)


def _save(fig, path: str | os.PathLike) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    # No "Software" tag (it names the matplotlib version): the same timeline gives the same bytes.
    fig.savefig(path, dpi=110, metadata={"Software": None})
    return Path(path)


def render_timelines(timelines: Sequence[tuple[str, StepTimeline]], path: str | os.PathLike) -> Path:
    """A PNG with one timeline per (title, timeline), top to bottom, on a shared time axis."""
    import matplotlib.style
    from matplotlib.figure import Figure

    # Our own Figure and Agg canvas, not pyplot: no global state, no display needed.
    with matplotlib.style.context("default"):
        fig = Figure(figsize=(11, 2.9 * len(timelines)), layout="constrained")
        axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False)[:, 0]
        for i, (ax, (title, timeline)) in enumerate(zip(axes, timelines)):
            _draw_timeline(ax, timeline, title, bottom=i == len(timelines) - 1)
        axes[0].set_xlim(0, max(t.duration_us for _, t in timelines) * 1e-3)
        return _save(fig, path)
