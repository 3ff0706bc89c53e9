"""ddp_overlap_individual_parameters_benchmarking (b): the profile page, from each machine's ``profile/profile.json``.

Numbers only (words: ``templates/{details/profile,answers/ddp_overlap_individual_parameters_benchmarking_b}.md.j2``);
every profiled step of rank 0 is reported, as two steps of one run give no interval."""

from __future__ import annotations

import gzip
import json

from cs336_systems.bench.profile.record import US, ProfileRecord
from cs336_systems.bench.profile.setting import ProfileSetting, nsys_command
from cs336_systems.results.paths import PROFILE_DIR
from cs336_systems.results.schema import SchemaError, from_json
from cs336_systems.writeup import coverage, fmt, templating
from cs336_systems.writeup.context import Page, RenderContext, details_link
from cs336_systems.writeup.load import MachineResults, ResultsFile
from cs336_systems.writeup.profile_figure import render_timelines

PROFILE_KIND = ProfileRecord.KIND
STEP_RUN = "ddp_step"  # the step benchmark's run the profile is compared with
SAME_WORKLOAD = ("model_size", "context_length", "global_batch", "seed", "world_size")
HEADERS = ["machine", "variant", "step", "all-reduce time inside backward", "all-reduce time (ms)", "backward (ms)",
           "step (ms)", "all-reduce events", "all-reduce calls"]
# One per all-reduce call in a torch profiler trace, whatever the backend logs beneath it: gloo on
# CUDA logs two "gloo:all_reduce" events per call (its worker's, beside its host-device copies).
CALL_EVENT = "c10d::allreduce_"


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
