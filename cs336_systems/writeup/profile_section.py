"""ddp_overlap_individual_parameters_benchmarking (b): the profile page, from each machine's ``profile/profile.json``.

Numbers only (words: ``templates/{details/profile,answers/ddp_overlap_individual_parameters_benchmarking_b}.md.j2``);
every profiled step of rank 0 is reported, as two steps of one run give no interval. The timelines
are drawn from the intervals ``profile.json`` stores: per variant the phases, backward compute and
the all-reduces, with backward's window shaded across the three lanes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterable, Sequence

from matplotlib.patches import Patch

from cs336_systems.bench.profile.record import US, ProfileRecord
from cs336_systems.bench.profile.setting import ProfileSetting, nsys_command
from cs336_systems.bench.profile.timeline import Interval, StepTimeline
from cs336_systems.results.paths import PROFILE_DIR
from cs336_systems.results.schema import SchemaError, from_json
from cs336_systems.writeup import coverage, fmt, templating
from cs336_systems.writeup.context import Page, RenderContext, details_link
from cs336_systems.writeup.figures import timeline_panels
from cs336_systems.writeup.load import MachineResults, ResultsFile

PROFILE_KIND = ProfileRecord.KIND
STEP_RUN = "ddp_step"  # the step benchmark's run the profile is compared with
SAME_WORKLOAD = ("model_size", "context_length", "global_batch", "seed", "world_size")
HEADERS = ["machine", "variant", "step", "all-reduce time inside backward", "all-reduce time (ms)", "backward (ms)",
           "step (ms)", "all-reduce events", "all-reduce calls"]
# One per all-reduce call in a torch profiler trace, whatever the backend logs beneath it: gloo on
# CUDA logs two "gloo:all_reduce" events per call (its worker's, beside its host-device copies).
CALL_EVENT = "c10d::allreduce_"


PHASE_STYLE = {  # label and colour of each phase bar
    "forward": ("forward", "#9ecae1"),
    "backward": ("backward", "#a1d99b"),
    "finish_gradient_synchronization": ("finish_gradient_synchronization", "#fdae6b"),
    "optimizer_step": ("optimizer step", "#bcbddc"),
}
COMPUTE_COLOR, COMM_COLOR, WINDOW_COLOR = "#31a354", "#de2d26", "0.92"
LANES = ("communication\n(all-reduce)", "backward\ncompute", "phase")  # bottom to top
ROW_HEIGHT_IN = 2.9  # inches per timeline
MS_PER_US = 1e-3


def _bars(intervals: Iterable[Interval]) -> list[tuple[float, float]]:
    """(start, width) in ms, as ``broken_barh`` wants them."""
    return [(a * MS_PER_US, (b - a) * MS_PER_US) for a, b in intervals]


def _draw_timeline(ax, title: str, timeline: StepTimeline, bottom: bool) -> None:
    b0, b1 = timeline.backward_range
    # The backward window across every lane: communication inside it is overlapped.
    ax.axvspan(b0 * MS_PER_US, b1 * MS_PER_US, color=WINDOW_COLOR, zorder=0)
    for name, span in timeline.phases.items():
        ax.broken_barh(_bars([span]), (1.6, 0.8), facecolor=PHASE_STYLE[name][1], edgecolor="0.3", linewidth=0.5)
    ax.broken_barh(_bars(timeline.backward_compute), (0.65, 0.7), facecolor=COMPUTE_COLOR)
    ax.broken_barh(_bars(timeline.communication), (-0.35, 0.7), facecolor=COMM_COLOR)
    ax.set_yticks(range(len(LANES)), LANES)
    ax.set_ylim(-0.6, 2.6)
    ax.set_title(
        f"{title}: {timeline.overlap_fraction:.0%} of all-reduce time inside backward "
        f"(all-reduce {timeline.communication_us * MS_PER_US:.1f} ms over {timeline.n_comm_events} profiler events, "
        f"backward {timeline.backward_us * MS_PER_US:.1f} ms)",
        fontsize=9,
        loc="left",
    )
    if bottom:  # one legend and axis label per figure, under the lowest timeline
        handles = [Patch(facecolor=color, label=label) for label, color in PHASE_STYLE.values()]
        handles.append(Patch(facecolor=WINDOW_COLOR, label="backward window"))
        ax.legend(handles=handles, loc="upper right", bbox_to_anchor=(1.0, -0.22), fontsize=7, ncol=5,
                  frameon=False)
        ax.set_xlabel("time since the step started (ms)", fontsize=8)


def render_timelines(timelines: Sequence[tuple[str, StepTimeline]], path: Path) -> Path:
    """A PNG with one timeline per (title, timeline), top to bottom, on a shared time axis."""
    return timeline_panels(timelines, _draw_timeline, lambda t: t.duration_us * MS_PER_US, path, ROW_HEIGHT_IN)


def _calls_per_step(machine: MachineResults, r: ProfileRecord) -> float | None:
    """All-reduce calls per profiled step, counted in the record's trace (None without the trace)."""
    path = machine.folder / PROFILE_DIR / r.trace
    if not path.is_file() or not r.timelines:
        return None
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        trace = json.load(f)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return sum(e.get("name") == CALL_EVENT for e in events) / len(r.timelines)


def _variant(r: ProfileRecord) -> dict:
    return dict(shares=r.overlap_fraction_per_step, backward=[t.backward_us * US for t in r.timelines],
                lanes=r.timeline.lanes_from)


def _workload(results: ResultsFile, machine: MachineResults) -> dict | None:
    """The step benchmark's file and the workload keys on which the profile differs from it."""
    step = machine.get(STEP_RUN)
    return step and dict(source=step.source, differing=[(k, results.setting.get(k), step.setting.get(k))
                                                        for k in SAME_WORKLOAD
                                                        if results.setting.get(k) != step.setting.get(k)])


def _nsys(results: ResultsFile) -> str | None:
    try:
        return nsys_command(from_json(ProfileSetting, results.setting))
    except (SchemaError, TypeError, ValueError):
        return None


def _machine(ctx: RenderContext, machine: MachineResults, results: ResultsFile) -> dict:
    records: list[ProfileRecord] = results.records
    stem, s = f"{machine.tag}_profile_timeline", results.setting
    drawn = {r.variant: render_timelines([(r.variant, r.timeline)], ctx.figure_path(f"{stem}_{r.variant}.png"))
             for r in records}
    both = render_timelines([(r.variant, r.timeline) for r in records], ctx.figure_path(f"{stem}_overlap.png"))
    v = {r.variant: _variant(r) for r in records}
    calls = {r.variant: _calls_per_step(machine, r) for r in records}
    return dict(tag=machine.tag, env=results.environment, s=s, v=v, naive=v.get("naive"), pp=v.get("per-parameter"),
                figures=[both, *drawn.values()], image=ctx.image(both, f"timelines on {machine.tag}"),
                answer_image=ctx.answer_image(both, f"naive and per-parameter DDP timelines on {machine.tag}"),
                alone=[(name, ctx.link(path)) for name, path in drawn.items()], nsys=_nsys(results),
                setting=fmt.workload_setting_line(results, f"{s.get('warmup_steps', '?')} warm-up and "
                                                  f"{s.get('steps', '?')} profiled steps per variant"),
                workload=_workload(results, machine), threads=results.notes.get("threads_per_rank"),
                ranks=results.notes.get("ranks_on_node") or results.environment.world_size,
                rows=[[f"`{machine.tag}`", r.variant, k + 1, fmt.pct(t.overlap_fraction),
                       fmt.ms(t.communication_us * US), fmt.ms(t.backward_us * US), fmt.ms(t.duration_us * US),
                       t.n_comm_events, "–" if calls[r.variant] is None else f"{calls[r.variant]:g}"]
                      for r in records for k, t in enumerate(r.timelines)])


def profile_page(ctx: RenderContext) -> Page:
    machines = [_machine(ctx, m, f) for m in ctx.inputs.machines for f in m.runs(PROFILE_KIND)]
    missing = [s.name for s in coverage.note_gaps(ctx, PROFILE_KIND, "the profiler timelines of naive and "
                                                  "per-parameter DDP")]
    rows = [row for m in machines for row in m["rows"]]
    values = dict(machines=machines, missing=missing, link=details_link("profile"),
                  table=fmt.table(HEADERS, rows, align="llrrrrrrr") if rows else None)
    answer = templating.render("answers/ddp_overlap_individual_parameters_benchmarking_b.md.j2",
                               **values, gaps=details_link("machines", "not-measured-here"))
    markdown = templating.render("details/profile.md.j2", **values, gaps="machines.md#not-measured-here")
    return Page("profile", markdown, {"ddp_overlap_individual_parameters_benchmarking": answer},
                [path for m in machines for path in m["figures"]])
