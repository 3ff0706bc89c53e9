"""One traced step: when the rank computed and when each collective ran, for the timeline.

A ``TorchDispatchMode`` notes the clock around every tensor operation on this thread (the
compute lane; operations less than ``BRIDGE_S`` apart form one bar, so the gaps left are
waits and Python work, not the interpreter's step from one operation to the next) and, for
each collective, the moment it was launched and the moment it completed: through its work's
future (a callback on the communication thread), or where a work has no future and never
reports completion (gloo's reduce-scatter), the moment the rank's wait for it returned, which
is an upper bound. While tracing, ``Work.wait`` is wrapped to note every wait: the time the
rank spent blocked on communication. Times are seconds since the step began. The mode's own
cost makes the traced step slower than a timed one; the record keeps both so a reader can judge.
On a GPU the compute lane shows the host queuing kernels, not the kernels running (the
profiler, bench/profile, sees those).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from cs336_systems.bench.fsdp.accounting import collective
from cs336_systems.bench.fsdp.record import FsdpTimeline
DECIMALS = 7  # 0.1 microsecond: finer than perf_counter's useful resolution here
BRIDGE_S = 1e-4


def bridge(intervals: list[tuple[float, float]], gap_s: float = BRIDGE_S) -> list[tuple[float, float]]:
    """Sorted intervals joined where less than ``gap_s`` apart (or overlapping)."""
    joined: list[list[float]] = []
    for start, end in sorted(intervals):
        if joined and start - joined[-1][1] < gap_s:
            joined[-1][1] = max(joined[-1][1], end)
        else:
            joined.append([start, end])
    return [(a, b) for a, b in joined]


def _work_of(out) -> dist.Work | None:
    """The work object a c10d operation returned (last in its outputs), unboxed."""
    work = out[-1] if isinstance(out, (tuple, list)) and out else out
    if isinstance(work, torch.ScriptObject):
        work = dist.Work.unbox(work)
    return work if isinstance(work, dist.Work) else None


class StepTracer(TorchDispatchMode):
    """Compute intervals and collective [launched, completed] intervals of one step."""

    def __init__(self, start: float):
        super().__init__()
        self.start = start
        self.compute: list[tuple[float, float]] = []
        self.collectives: list[tuple[str, list[float | None]]] = []
        self.waits: list[tuple[float, float]] = []
        self._by_wait: dict[int, tuple[dist.Work, list[float | None]]] = {}  # stamped when waited for
        self._unwrapped_wait = dist.Work.wait

    def _stamp(self, span: list[float | None]) -> None:
        span[1] = time.perf_counter() - self.start

    def _wait(self, work: dist.Work, *args, **kwargs):
        begin = time.perf_counter()
        try:
            return self._unwrapped_wait(work, *args, **kwargs)
        finally:
            end = time.perf_counter()
            self.waits.append((begin - self.start, end - self.start))
            pending = self._by_wait.pop(id(work), None)
            if pending is not None and pending[1][1] is None:
                pending[1][1] = end - self.start

    def __enter__(self):
        tracer = self
        dist.Work.wait = lambda work, *args, **kwargs: tracer._wait(work, *args, **kwargs)
        return super().__enter__()

    def __exit__(self, *exc):
        dist.Work.wait = self._unwrapped_wait
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        begin = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        end = time.perf_counter()
        found = collective(func, args)
        if found is None:
            self.compute.append((begin - self.start, end - self.start))
            return out
        span: list[float | None] = [begin - self.start, None]
        self.collectives.append((found[0], span))
        work = _work_of(out)
        if work is None:
            span[1] = end - self.start
            return out
        try:
            work.get_future().then(lambda _, s=span: self._stamp(s))
        except RuntimeError:  # this kind of work has no future: its wait will tell
            self._by_wait[id(work)] = (work, span)  # holding the work keeps its id unique
        return out

    def timeline(self, phases: dict[str, tuple[float, float]], timed_median_s: float) -> FsdpTimeline:
        """The trace as stored; call once every collective of the step was waited for."""
        step_end = max(end for _, end in phases.values()) - self.start
        by_kind: dict[str, list[list[float]]] = {}
        for kind, (launched, done) in self.collectives:
            done = step_end if done is None else done  # a callback not yet run: done by the step's end
            by_kind.setdefault(kind, []).append([round(launched, DECIMALS), round(done, DECIMALS)])
        return FsdpTimeline(
            duration_s=round(step_end, DECIMALS),
            phases={name: [round(a - self.start, DECIMALS), round(b - self.start, DECIMALS)]
                    for name, (a, b) in phases.items()},
            compute=[[round(a, DECIMALS), round(b, DECIMALS)] for a, b in bridge(self.compute)],
            collectives=by_kind,
            waits=[[round(a, DECIMALS), round(b, DECIMALS)] for a, b in self.waits],
            timed_median_s=timed_median_s,
        )
