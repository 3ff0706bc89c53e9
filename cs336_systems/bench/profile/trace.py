"""Reading a ``torch.profiler`` Chrome trace into step timelines, with lanes chosen by backend.

Two lanes on one clock per ``train_step`` range:

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

Traces are saved as ``trace_<variant>.json``, gzipped past a few MB (Perfetto and
chrome://tracing open ``.json.gz`` directly).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any, Iterable

from cs336_systems.bench.profile.timeline import PHASES, Interval, StepTimeline, merge_intervals

STEP_RANGE = "train_step"
GLOO_ALL_REDUCE = "gloo:all_reduce"
ENQUEUE_ALL_REDUCE = "c10d::allreduce_"
BACKENDS = ("gloo", "nccl")
AUTOGRAD_NODE_PREFIX = "autograd::engine::evaluate_function:"
# Chrome traces of a bigger model run to tens of MB; past this size we store them gzipped.
MAX_PLAIN_TRACE_BYTES = 5 * 2**20


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
    """A Chrome trace as saved by :func:`save_trace` (plain or gzipped JSON)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def trace_names(variant: str) -> tuple[str, str]:
    """The two names a variant's trace may have: plain and gzipped."""
    plain = f"trace_{variant}.json"
    return plain, plain + ".gz"


def save_trace(trace_text: str, folder: Path, variant: str) -> Path:
    """Write a variant's trace into ``folder``, gzipped when large; returns its path."""
    plain, zipped = (folder / name for name in trace_names(variant))
    data = trace_text.encode()
    if len(data) <= MAX_PLAIN_TRACE_BYTES:
        plain.write_bytes(data)
        return plain
    with open(zipped, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(data)
    return zipped
