"""Problem 5b's profile: a table of each variant's profiled step and its timelines, from ``profile.json``.

Part of the per-parameter overlap section (ddp_sections.py). The timelines are drawn here from
the intervals the profiler stored (profile_figure.py), not copied from pictures it made.
"""

from __future__ import annotations

from pathlib import Path

from cs336_systems.bench.profile.record import ProfileRecord
from cs336_systems.writeup import fmt
from cs336_systems.writeup.context import RenderContext
from cs336_systems.writeup.load import MachineResults, ResultsFile
from cs336_systems.writeup.profile_figure import render_timelines

PROFILE_KIND = ProfileRecord.KIND
COMBINED_TIMELINE = "timeline_overlap"  # every variant, one above the other, on one time axis

HEADERS = ["variant", "all-reduce time inside backward", "all-reduce time (ms)", "backward (ms)", "step (ms)",
           "all-reduce events", "lanes from"]


def _setting_line(results: ResultsFile) -> str:
    env, setting = results.environment, results.setting
    parts = [f"backend {env.backend}", f"world size {env.world_size}", f"model {setting.get('model_size', '?')}",
             f"global batch {setting.get('global_batch', '?')} × context {setting.get('context_length', '?')}"]
    return fmt.setting_line(env, results.source, parts=parts)


def _row(r: ProfileRecord) -> list:
    return [r.variant, fmt.pct(r.overlap_fraction), fmt.ms(r.communication_s), fmt.ms(r.backward_s), fmt.ms(r.step_s),
            r.n_comm_events, r.lanes_from]


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
                fmt.table(HEADERS, [_row(r) for r in records], align="lrrrrrl")]
        fractions = {r.variant: r.overlap_fraction for r in records}
        if "naive" in fractions and "per-parameter" in fractions:
            out += ["", f"In the profiled step, {fmt.pct(fractions['per-parameter'])} of per-parameter DDP's "
                        f"all-reduce time lies inside backward, against {fmt.pct(fractions['naive'])} for naive DDP."]
        drawn = _figures(ctx, machine, records)
        figures += drawn.values()
        # The side-by-side timeline shows every variant on one time axis: embed it, link the rest.
        embedded = [COMBINED_TIMELINE] if COMBINED_TIMELINE in drawn else list(drawn)
        for stem in embedded:
            out += ["", ctx.image(drawn[stem], f"{stem.replace('_', ' ')} on {machine.tag}")]
        linked = [stem for stem in drawn if stem not in embedded]
        if linked:
            out += ["", "Each alone: " + ", ".join(f"[{stem}]({ctx.link(drawn[stem])})" for stem in linked) + "."]
    return out, figures
