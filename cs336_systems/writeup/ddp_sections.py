"""Problems 3 to 5 and every variant side by side: the DDP step benchmark read variant by variant.

Every section here reads the same DDP step runs (``ddp_step*.json`` but the ablation; all
variants of a run were timed in one interleaved run), picks the variants its problem is about,
compares them only through paired per-round differences with their 95% intervals
(paired.py), and says why, from the run's own measurements: the all-reduce line fitted on the
same machine, flat's copies timed beside its steps, and the profile. Problem 2 is in
naive_ddp_section.py, the bucket sweep (6a) in bucketed_section.py, the profile of problem 5b in
profile_section.py, the frame and tables every section shares in step_tables.py.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import COMPUTE_ONLY, TORCH_DDP
from cs336_systems.writeup import fmt
from cs336_systems.writeup.allreduce_analysis import LinkFit
from cs336_systems.writeup.bucketed_section import bucketed_benchmarking_section
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import not_measured_notes
from cs336_systems.writeup.ddp_analysis import by_variant, gradient_bytes, run_fit
from cs336_systems.writeup.ddp_figures import step_time_figure
from cs336_systems.writeup.load import MachineResults, ResultsFile
from cs336_systems.writeup.paired import difference_clause, paired, paired_sync, paired_table, signed_ms
from cs336_systems.writeup.profile_section import PROFILE_KIND, profile_part
from cs336_systems.writeup.step_setting import why_not_handout_model
from cs336_systems.writeup.step_tables import (
    COLUMNS_TEXT,
    compared,
    ddp_section,
    ddp_setting_line,
    variant_table,
)

__all__ = [
    "COMPUTE_ONLY", "TORCH_DDP", "all_variants_section", "bucketed_benchmarking_section", "ddp_setting_line",
    "flat_benchmarking_section", "naive_benchmarking_section", "overlap_benchmarking_section",
]
FIT_SOURCE = "The all-reduce line fitted to this machine's all-reduce benchmark (distributed_communication_single_node)"


def _fit_text(fit: LinkFit | str | None) -> str | None:
    """"(o = 530 µs, w = 1.16 GB/s)", or why no prediction can be made."""
    if fit is None:
        return ("No all-reduce run of this backend and world size on this machine, so no prediction: "
                "**not measured here**; `make bench` fills it.")
    if isinstance(fit, str):
        return f"The all-reduce line could not be fitted here ({fit}), so no prediction."
    return None


# ---------------------------------------------------------------------------------------------
# Problem 3: naive DDP's step time and communication share


def _naive_text(v: dict[str, StepRecord], fit: LinkFit | str | None, s_bytes: float | None) -> str:
    naive, floor = v["naive"], v[COMPUTE_ONLY]
    calls = naive.allreduce_calls_per_step or 0
    ratio_of_medians = naive.median_sync_s / naive.median_step_s if naive.median_sync_s else None
    text = [
        f"Naive DDP's step takes {fmt.ms(naive.median_step_s)} ms (median of {naive.steps_timed} steps) against the "
        f"compute-only step's {fmt.ms(floor.median_step_s)} ms; {difference_clause(paired(naive, floor))}.",
        f"Its synchronisation after backward, {calls:g} all-reduces one after another, takes "
        f"{fmt.ms(naive.median_sync_s)} ms (median): {fmt.pct(naive.sync_share)} of the step as the median of per-step "
        f"ratios, {fmt.pct(ratio_of_medians)} as the ratio of the two medians.",
    ]
    why = _fit_text(fit)
    if why is None and s_bytes:
        assert isinstance(fit, LinkFit)
        predicted = calls * fit.o_s + s_bytes / fit.w_bytes_per_s
        text.append(
            f"Why it costs this much: none of it overlaps backward, and every call pays the per-call cost. "
            f"{FIT_SOURCE} (o = {fmt.us(fit.o_s)} µs, w = {fmt.gbps(fit.w_bytes_per_s)} "
            f"GB/s) predicts {calls:g} × o + s/w = {fmt.ms(predicted)} ms for {calls:g} calls moving s = "
            f"{fmt.mb(s_bytes)} MB; the measured {fmt.ms(naive.median_sync_s)} ms are "
            f"{fmt.ratio(naive.median_sync_s / predicted)} that.")
    elif why:
        text.append(why)
    return " ".join(text)


def naive_benchmarking_section(ctx: RenderContext) -> Section:
    def body(machine: MachineResults, results: ResultsFile):
        v = by_variant(results.records)
        text = compared(results, [COMPUTE_ONLY, "naive"], [COMPUTE_ONLY, "naive"],
                           lambda v: _naive_text(v, run_fit(machine, results), gradient_bytes(results)))
        floor = v.get(COMPUTE_ONLY)
        setting = results.setting
        steps = setting.get("warmup_steps", 0) + setting.get("rounds", 0) * setting.get("steps_per_round", 0)
        xl = why_not_handout_model(setting, results.environment, results.notes,
                                   floor.median_step_s if floor else None, steps, len(results.records))
        return "\n\n".join([text, COLUMNS_TEXT, *([xl] if xl else [])]), []

    return ddp_section(ctx, "## naive_ddp_benchmarking: naive DDP's step time and time communicating",
                       "Training steps of the benchmark model with naive DDP beside the same steps with no "
                       "communication at all (compute-only), timed in the same interleaved run.", body,
                       shown=[COMPUTE_ONLY, "naive"], full_setting=True)


# ---------------------------------------------------------------------------------------------
# Problem 4: one flat all-reduce instead of one per parameter


def _flat_breakdown(flat: StepRecord, fit: LinkFit | str | None, s_bytes: float | None) -> str:
    """Where flat's synchronisation time goes: its copies (timed beside its steps) and the all-reduce."""
    sync = flat.median_sync_s or 0.0
    parts = []
    copies = 0.0
    if flat.pack_times_s and flat.unpack_times_s:
        pack, unpack = statistics.median(flat.pack_times_s), statistics.median(flat.unpack_times_s)
        copies = pack + unpack
        parts.append(f"Flat's synchronisation is a copy of every gradient into one flat buffer, one all-reduce, and a "
                     f"copy back. Timed beside each step on buffers like flat's, the copy in takes {fmt.ms(pack)} ms "
                     f"and the copy back {fmt.ms(unpack)} ms (medians, slowest rank): {fmt.pct(copies / sync)} of its "
                     f"{fmt.ms(sync)} ms.")
    else:
        parts.append("This run did not time flat's copies, so its synchronisation cannot be split here.")
    why = _fit_text(fit)
    if why is None and s_bytes:
        assert isinstance(fit, LinkFit)
        predicted = fit.o_s + s_bytes / fit.w_bytes_per_s
        left = sync - copies
        parts.append(f"{FIT_SOURCE} predicts o + s/w = {fmt.ms(predicted)} ms for one "
                     f"all-reduce of s = {fmt.mb(s_bytes)} MB; the synchronisation takes "
                     f"{fmt.ratio(sync / predicted)} that" + (
                         f", and without the copies {fmt.ms(left)} ms are left for the all-reduce itself, "
                         f"{fmt.ratio(left / predicted)} the prediction." if copies else "."))
        if copies and left > predicted:
            parts.append(f"The copies do not explain the remaining {fmt.ms(left - predicted)} ms: the all-reduce "
                         "itself runs slower inside the training step, right after backward, than it ran alone "
                         "between barriers in the all-reduce benchmark.")
    elif why:
        parts.append(why)
    return " ".join(parts)


def _flat_text(v: dict[str, StepRecord], fit: LinkFit | str | None, s_bytes: float | None) -> str:
    naive, flat = v["naive"], v["flat"]
    sync = paired_sync(flat, naive)
    parts = [f"Flat DDP makes {flat.allreduce_calls_per_step or 0:g} all-reduce call per step where naive makes "
             f"{naive.allreduce_calls_per_step or 0:g}, so it pays the per-call cost once: "
             f"{difference_clause(paired(flat, naive))}."]
    if sync:
        parts.append(f"Their synchronisation after backward, round by round: {difference_clause(sync)}.")
    return " ".join([*parts, _flat_breakdown(flat, fit, s_bytes)])


def flat_benchmarking_section(ctx: RenderContext) -> Section:
    def body(machine: MachineResults, results: ResultsFile):
        return compared(results, [COMPUTE_ONLY, "naive", "flat"], ["naive", "flat"],
                           lambda v: _flat_text(v, run_fit(machine, results), gradient_bytes(results))), []

    return ddp_section(ctx, "## minimal_ddp_flat_benchmarking: one flat all-reduce against one per parameter",
                       "Naive DDP against flat DDP, which copies all gradients into one buffer and all-reduces it "
                       "with a single call (same run, same model; columns as defined under naive_ddp_benchmarking).",
                       body, shown=[COMPUTE_ONLY, "naive", "flat"])


# ---------------------------------------------------------------------------------------------
# Problem 5: per-parameter overlap, with the profiler's timelines


def _overlap_text(v: dict[str, StepRecord]) -> str:
    per_parameter, naive, flat = v["per-parameter"], v["naive"], v["flat"]
    sync, step = paired_sync(per_parameter, naive), paired(per_parameter, naive)
    text = [f"Per-parameter DDP against naive: {difference_clause(step)}; against flat: "
            f"{difference_clause(paired(per_parameter, flat))}.",
            f"What remains of its communication after backward is a wait of {fmt.ms(per_parameter.median_sync_s)} ms "
            f"(median) against naive's {fmt.ms(naive.median_sync_s)} ms of all-reduces"
            + (f"; {difference_clause(sync)}." if sync else ".")]
    if sync and sync.median_s < step.median_s:
        text.append(f"The time after backward shrinks by more than the step does ({signed_ms(sync.median_s)} against "
                    f"{signed_ms(step.median_s)} ms per round): overlapping moved the all-reduces into backward, and "
                    "the profile below shows what that costs backward.")
    return " ".join(text)


def overlap_benchmarking_section(ctx: RenderContext) -> Section:
    profiled: set[str] = set()

    def body(machine: MachineResults, results: ResultsFile):
        text = compared(results, [COMPUTE_ONLY, "naive", "flat", "per-parameter"],
                           ["naive", "flat", "per-parameter"], _overlap_text)
        lines, figures = [], []
        if machine.tag not in profiled:  # the machine's profile once, under its first run
            profiled.add(machine.tag)
            lines, figures = profile_part(ctx, machine)
        return "\n".join([text, *lines]), figures

    def unmatched_profiles() -> tuple[list[str], list[Path]]:
        """Machines profiled without a step run: their profile under their own heading."""
        lines, figures = [], []
        for machine in ctx.inputs.machines:
            if machine.tag not in profiled and machine.runs(PROFILE_KIND):
                part, figs = profile_part(ctx, machine)
                lines += ["", f"### Machine `{machine.tag}`", *part]
                figures += figs
        return lines, figures

    return ddp_section(ctx, "## ddp_overlap_individual_parameters_benchmarking: overlapping each parameter's "
                            "all-reduce",
                       "Per-parameter DDP starts each gradient's all-reduce from a hook as soon as backward "
                       "produces it; naive and flat wait for backward to end. The profiler's timelines (one "
                       "step, rank 0) show where the all-reduces fall relative to backward (columns as defined "
                       "under naive_ddp_benchmarking).", body,
                       tail=unmatched_profiles, shown=[COMPUTE_ONLY, "naive", "flat", "per-parameter"],
                       more_notes=not_measured_notes(ctx.inputs, PROFILE_KIND, "Profiler timelines"))


# ---------------------------------------------------------------------------------------------
# Every variant side by side


def all_variants_section(ctx: RenderContext) -> Section:
    def body(machine: MachineResults, results: ResultsFile):
        records = results.records
        path = step_time_figure(records, f"step time per variant on {machine.tag}",
                                ctx.figure_path(f"{machine.tag}_{results.name}_step_time.png"))
        text = [variant_table(records), "", ctx.image(path, f"step time per variant on {machine.tag}")]
        v = by_variant(records)
        baseline = v.get("naive")
        others = [r for r in records if r.variant not in (COMPUTE_ONLY, "naive")]
        if baseline is not None and others:
            differences = [paired(r, baseline) for r in others]
            resolved = [d for d in differences if d.resolved]
            text += ["", "Each variant against naive DDP, the baseline every other variant improves on, round by "
                         "round:", "", paired_table(differences), ""]
            if all(d.interval_s is None for d in differences):
                text.append(f"{differences[0].rounds} rounds give no 95% interval, so no variant is ranked here.")
            else:
                verb = "excludes" if len(resolved) == 1 else "exclude"
                text.append(f"{len(resolved)} of the {len(differences)} differences {verb} zero at 95%; the others "
                            "are not told apart here, whatever their medians' order.")
        return "\n".join(text), [path]

    return ddp_section(ctx, "## All DDP variants: step time side by side",
                       "Every variant of each DDP step run (columns as defined under naive_ddp_benchmarking). The "
                       "figure stacks each variant's median time outside its synchronisation after backward and "
                       "the median synchronisation, and beside it draws each exposed overhead with its paired 95% "
                       "interval.", body)
