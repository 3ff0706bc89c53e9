"""Problem 5b's profile: a table of each variant's profiled steps and its timelines, from ``profile.json``.

Part of the per-parameter overlap section (ddp_sections.py). The timelines are drawn here from
the intervals the profiler stored (profile_figure.py), not copied from pictures it made. Beside
them: what the profile says about *why* overlap costs what it does on this machine
(:func:`overlap_cost`, also read by the bucket-sweep answer), whether it trained the step
benchmark's batch, and that it comes from torch.profiler, with the Nsight Systems command
that records the same run.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from cs336_systems.bench.profile.record import US, ProfileRecord
from cs336_systems.bench.profile.setting import ProfileSetting, nsys_command
from cs336_systems.results.schema import SchemaError, from_json
from cs336_systems.writeup import fmt
from cs336_systems.writeup.context import RenderContext
from cs336_systems.writeup.load import MachineResults, ResultsFile
from cs336_systems.writeup.profile_figure import render_timelines
from cs336_systems.writeup.step_setting import gpu_notes, threads_sentence

PROFILE_KIND = ProfileRecord.KIND
COMBINED_TIMELINE = "timeline_overlap"  # every variant, one above the other, on one time axis
STEP_RUN = "ddp_step"  # the step benchmark's run the profile is compared with
SAME_WORKLOAD = ("model_size", "context_length", "global_batch", "seed", "world_size")

HEADERS = ["variant", "all-reduce time inside backward", "all-reduce time (ms)", "backward (ms)", "step (ms)",
           "all-reduce events", "lanes from"]
COLUMNS_TEXT = (
    "Columns (the last profiled step of rank 0): *all-reduce time inside backward*: the share of the all-reduce "
    "time that lies inside backward's range; *all-reduce time*: the union of the all-reduce intervals (concurrent "
    "calls count once); *backward*: backward's range; *step*: the whole `train_step` range; *all-reduce events*: "
    "all-reduce calls in the step; *lanes from*: which profiler events make the compute and communication lanes."
)


def _setting_line(results: ResultsFile) -> str:
    setting = results.setting
    return fmt.workload_setting_line(
        results, f"{setting.get('warmup_steps', '?')} warm-up and {setting.get('steps', '?')} profiled steps per variant")


def _row(r: ProfileRecord) -> list:
    return [r.variant, fmt.pct(r.overlap_fraction), fmt.ms(r.communication_s), fmt.ms(r.backward_s), fmt.ms(r.step_s),
            r.n_comm_events, r.lanes_from]


def _median_backward_s(r: ProfileRecord) -> float:
    return statistics.median(t.backward_us for t in r.timelines) * US


def _median_communication_s(r: ProfileRecord) -> float:
    return statistics.median(t.communication_us for t in r.timelines) * US


def overlap_cost(results: ResultsFile) -> str | None:
    """Why overlapping costs backward time here, from naive's and per-parameter's profiled steps and
    the run's threads and cores; None without both variants."""
    v = {r.variant: r for r in results.records}
    if "naive" not in v or "per-parameter" not in v:
        return None
    naive, overlapped = v["naive"], v["per-parameter"]
    b0, b1 = _median_backward_s(naive), _median_backward_s(overlapped)
    a0, a1 = _median_communication_s(naive), _median_communication_s(overlapped)
    steps = len(overlapped.timelines)
    backward_word = "longer" if b1 > b0 else "no longer"
    comm_word = "longer" if a1 > a0 else "no longer"
    text = (f"In the profiled steps (median of {steps}, rank 0; one run, so no interval), per-parameter DDP's backward "
            f"took {fmt.ms(b1)} ms against naive's {fmt.ms(b0)} ms ({'+' if b1 >= b0 else ''}{fmt.pct(b1 / b0 - 1)}), "
            f"and its all-reduces {fmt.ms(a1)} ms in all against naive's {fmt.ms(a0)} ms, where they ran after "
            "backward. ")
    env = results.environment
    if env.device_type == "cpu":
        text += threads_sentence(env, results.notes) + " "
        if b1 > b0 or a1 > a0:
            text += (f"That is why overlap is not free here: moved into backward, the all-reduces take cores from "
                     f"backward instead of using idle ones, so backward is {backward_word} and the all-reduces are "
                     f"{comm_word} than when each had the cores to itself.")
        else:
            text += "Overlapping did not lengthen either here: communication found cores to spare."
    else:
        text += " ".join(gpu_notes(env))
    return text


def _same_workload(results: ResultsFile, machine: MachineResults) -> str:
    """Whether the profile trained the step benchmark's model and batch (``make bench`` passes both the same flags)."""
    step = machine.get(STEP_RUN)
    if step is None:
        return f"This machine has no `{STEP_RUN}.json` to compare the profiled workload with."
    mine, theirs = results.setting, step.setting
    differing = [k for k in SAME_WORKLOAD if mine.get(k) != theirs.get(k)]
    if differing:
        listed = ", ".join(f"{k} {mine.get(k)} here against {theirs.get(k)}" for k in differing)
        return f"The profile's workload differs from the step benchmark's (`{step.source}`): {listed}."
    shared = ", ".join(f"{k} {mine.get(k)}" for k in SAME_WORKLOAD)
    return (f"The profile trains the same model on the same batch as the step benchmark's run (`{step.source}`: "
            f"{shared}); the benchmark suites pass both scripts the same workload flags.")


def _profiler_note(results: ResultsFile) -> str:
    """Where the timelines come from, and the Nsight Systems command the handout's tool would need."""
    text = ("These timelines come from `torch.profiler` (its Chrome trace, reduced to intervals), not from Nsight "
            "Systems, which the handout names")
    try:
        setting = from_json(ProfileSetting, results.setting)
    except (SchemaError, TypeError, ValueError):
        return text + "; this file's setting is not a ProfileSetting, so no nsys command is given."
    return (text + ": Nsight profiles CUDA, and on a machine with NVIDIA GPUs `scripts/profile_ddp.py` prints the "
            f"command that records the same run with NCCL:\n\n```\n{nsys_command(setting)}\n```")


def _figures(ctx: RenderContext, machine: MachineResults, records: list[ProfileRecord]) -> dict[str, Path]:
    """Each variant's last profiled step alone, and all of them together (when there are several)."""
    drawn = {}
    for r in records:
        stem = f"timeline_{r.variant}"
        drawn[stem] = render_timelines([(r.variant, r.timeline)], ctx.figure_path(f"{machine.tag}_profile_{stem}.png"))
    if len(records) > 1:
        path = ctx.figure_path(f"{machine.tag}_profile_{COMBINED_TIMELINE}.png")
        drawn[COMBINED_TIMELINE] = render_timelines([(r.variant, r.timeline) for r in records], path)
    return drawn


def profile_part(ctx: RenderContext, machine: MachineResults) -> tuple[list[str], list[Path]]:
    """Markdown lines (starting with a blank one) and figures for every profile run of ``machine``."""
    out: list[str] = []
    figures: list[Path] = []
    for results in machine.runs(PROFILE_KIND):
        records: list[ProfileRecord] = results.records
        out += ["", f"#### Profile of one step on `{machine.tag}`", "", _setting_line(results), "",
                _same_workload(results, machine), "",
                fmt.table(HEADERS, [_row(r) for r in records], align="lrrrrrl"), "", COLUMNS_TEXT]
        fractions = {r.variant: r.overlap_fraction for r in records}
        if "naive" in fractions and "per-parameter" in fractions:
            out += ["", f"In the profiled step, {fmt.pct(fractions['per-parameter'])} of per-parameter DDP's "
                        f"all-reduce time lies inside backward, against {fmt.pct(fractions['naive'])} for naive DDP."]
        cost = overlap_cost(results)
        if cost:
            out += ["", cost]
        drawn = _figures(ctx, machine, records)
        figures += drawn.values()
        # The side-by-side timeline shows every variant on one time axis: embed it, link the rest.
        embedded = [COMBINED_TIMELINE] if COMBINED_TIMELINE in drawn else list(drawn)
        for stem in embedded:
            out += ["", ctx.image(drawn[stem], f"{stem.replace('_', ' ')} on {machine.tag}")]
        linked = [stem for stem in drawn if stem not in embedded]
        if linked:
            out += ["", "Each alone: " + ", ".join(f"[{stem}]({ctx.link(drawn[stem])})" for stem in linked) + "."]
        out += ["", _profiler_note(results)]
    return out, figures
