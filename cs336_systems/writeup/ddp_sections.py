"""Problems 3 to 6a: the DDP step benchmark read variant by variant, and every variant side by side.

Every section here reads the same DDP step runs (``ddp_step*.json`` but the ablation; all
variants of a run were timed in one interleaved run), picks the variants its problem is about,
and compares them. Problem 2 is in naive_ddp_section.py, the profile of problem 5b in
profile_section.py, the frame and tables every section shares in step_tables.py.
"""

from __future__ import annotations

from pathlib import Path

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import COMPUTE_ONLY, TORCH_DDP
from cs336_systems.writeup import fmt
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import not_measured_notes
from cs336_systems.writeup.ddp_analysis import bucket_sweep
from cs336_systems.writeup.ddp_figures import bucket_sweep_figure, step_time_figure
from cs336_systems.writeup.naive_ddp_section import naive_ddp_section
from cs336_systems.writeup.profile_section import PROFILE_KIND, profile_part
from cs336_systems.writeup.step_tables import (
    VARIANT_HEADERS,
    compared,
    ddp_section,
    ddp_setting_line,
    pick,
    variant_row,
    variant_table,
)

__all__ = [
    "COMPUTE_ONLY", "TORCH_DDP", "all_variants_section", "bucketed_benchmarking_section", "ddp_setting_line",
    "flat_benchmarking_section", "naive_benchmarking_section", "naive_ddp_section", "overlap_benchmarking_section",
]


# ---------------------------------------------------------------------------------------------
# Problem 3: naive DDP's step time and communication share


def _naive_text(v: dict[str, StepRecord]) -> str:
    naive, floor = v["naive"], v[COMPUTE_ONLY]
    return (
        f"Naive DDP's step takes {fmt.ms(naive.median_step_s)} ms (median of {naive.steps_timed} steps), "
        f"{fmt.ratio(naive.median_step_s / floor.median_step_s)} the compute-only step "
        f"({fmt.ms(floor.median_step_s)} ms). In the median step {fmt.pct(naive.sync_share)} of the time "
        f"goes to its {naive.allreduce_calls_per_step or 0:g} all-reduces after backward "
        f"({fmt.ms(naive.median_sync_s)} ms, median); the exposed overhead (per round, step time minus "
        f"compute-only step time; median over rounds) is {fmt.ms(naive.exposed_overhead_s)} ms "
        f"({fmt.pct(naive.exposed_share)} of the step)."
    )


def naive_benchmarking_section(ctx: RenderContext) -> Section:
    def body(machine, results):
        return compared(results, [COMPUTE_ONLY, "naive"], [COMPUTE_ONLY, "naive"], _naive_text), []

    return ddp_section(ctx, "## naive_ddp_benchmarking: naive DDP's step time and time communicating",
                       "Training steps of the benchmark model with naive DDP beside the same steps with no "
                       "communication at all (compute-only), timed in the same interleaved run.", body)


# ---------------------------------------------------------------------------------------------
# Problem 4: one flat all-reduce instead of one per parameter


def _flat_text(v: dict[str, StepRecord]) -> str:
    naive, flat = v["naive"], v["flat"]
    return (
        f"Flat DDP makes {flat.allreduce_calls_per_step or 0:g} all-reduce call per step where naive makes "
        f"{naive.allreduce_calls_per_step or 0:g}: "
        + fmt.compare("flat", flat.median_step_s, "naive", naive.median_step_s)
        + f" per step, and its synchronisation after backward takes {fmt.ms(flat.median_sync_s)} ms against "
        f"{fmt.ms(naive.median_sync_s)} ms "
        f"({fmt.ratio(naive.median_sync_s / flat.median_sync_s)} less time)."
    )


def flat_benchmarking_section(ctx: RenderContext) -> Section:
    def body(machine, results):
        return compared(results, [COMPUTE_ONLY, "naive", "flat"], ["naive", "flat"], _flat_text), []

    return ddp_section(ctx, "## minimal_ddp_flat_benchmarking: one flat all-reduce against one per parameter",
                       "Naive DDP against flat DDP, which copies all gradients into one buffer and all-reduces it "
                       "with a single call (same run, same model).", body)


# ---------------------------------------------------------------------------------------------
# Problem 5: per-parameter overlap, with the profiler's timelines


def _overlap_text(v: dict[str, StepRecord]) -> str:
    per_parameter, naive, flat = v["per-parameter"], v["naive"], v["flat"]
    return (
        fmt.compare("Per-parameter DDP", per_parameter.median_step_s, "naive", naive.median_step_s) + "; "
        + fmt.compare("it", per_parameter.median_step_s, "flat", flat.median_step_s)
        + f". What remains of its communication after backward is a wait of {fmt.ms(per_parameter.median_sync_s)} "
        f"ms (median), against naive's {fmt.ms(naive.median_sync_s)} ms of all-reduces after backward."
    )


def overlap_benchmarking_section(ctx: RenderContext) -> Section:
    profiled: set[str] = set()

    def body(machine, results):
        text = compared(results, [COMPUTE_ONLY, "naive", "flat", "per-parameter"], ["naive", "flat", "per-parameter"],
                        _overlap_text)
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
                       "step, rank 0) show where the all-reduces fall relative to backward.", body,
                       tail=unmatched_profiles,
                       more_notes=not_measured_notes(ctx.inputs, PROFILE_KIND, "Profiler timelines"))


# ---------------------------------------------------------------------------------------------
# Problem 6a: the bucket-size sweep


def _sweep_sentences(sweep: list[StepRecord], references: list[StepRecord]) -> list[str]:
    best = min(sweep, key=lambda r: r.median_step_s)
    worst = max(sweep, key=lambda r: r.median_step_s)
    sentences = [
        f"Of the {len(sweep)} bucket sizes tried, {fmt.size_mb(best.bucket_size_mb)} MB "
        f"({best.n_buckets} buckets) gives the fastest step, {fmt.ms(best.median_step_s)} ms, "
        f"{fmt.ratio(worst.median_step_s / best.median_step_s)} faster than the slowest, "
        f"{fmt.size_mb(worst.bucket_size_mb)} MB ({fmt.ms(worst.median_step_s)} ms)."
    ]
    others = [r for r in references if r.variant != COMPUTE_ONLY]
    if others:
        parts = [fmt.relative(best.median_step_s, r.variant, r.median_step_s) for r in others]
        listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        sentences.append(f"That step is {listed}.")
    lowest = min(sweep, key=lambda r: r.exposed_overhead_s)
    interval = lowest.exposed_overhead_ci95_s
    sentences.append(
        f"By exposed overhead, which pairs each step with the compute-only step of its own round and so "
        f"leaves out most of the machine's drift, the lowest is {fmt.size_mb(lowest.bucket_size_mb)} MB's, "
        f"{fmt.ms(lowest.exposed_overhead_s)} ms"
        + (f" (95% interval {fmt.ms_interval(interval)} ms)." if interval else ".")
    )
    return sentences


def bucketed_benchmarking_section(ctx: RenderContext) -> Section:
    def body(machine, results):
        sweep = bucket_sweep(results.records)
        references = pick(results.records, ["per-parameter", "flat", TORCH_DDP, COMPUTE_ONLY])
        if not sweep:
            return f"{variant_table(references)}\n\nThis run has no bucketed variant.", []
        sweep_table = fmt.table(["bucket size (MB)", *VARIANT_HEADERS],
                                [[fmt.size_mb(r.bucket_size_mb), *variant_row(r)] for r in sweep])
        model_size = results.setting.get("model_size", "")
        path = bucket_sweep_figure(sweep, {r.variant: r for r in references},
                                   f"bucket sweep, model {model_size} on {machine.tag}",
                                   ctx.figure_path(f"{machine.tag}_{results.name}_bucket_sweep.png"))
        text = "\n".join([sweep_table, "", "Other variants of the same run, for reference:", "",
                          variant_table(references), "", ctx.image(path, f"bucket sweep on {machine.tag}"), "",
                          " ".join(_sweep_sentences(sweep, references))])
        return text, [path]

    return ddp_section(ctx, "## ddp_bucketed_benchmarking: bucket size sweep",
                       "Bucketed DDP with each bucket size of the sweep, beside per-parameter, flat and "
                       "PyTorch's `DistributedDataParallel` at its default bucket size, all from the same run.",
                       body)


# ---------------------------------------------------------------------------------------------
# Every variant side by side


def all_variants_section(ctx: RenderContext) -> Section:
    def body(machine, results):
        records = results.records
        path = step_time_figure(records, f"step time per variant on {machine.tag}",
                                ctx.figure_path(f"{machine.tag}_{results.name}_step_time.png"))
        ddp = [r for r in records if r.variant != COMPUTE_ONLY]
        text = [variant_table(records), "", ctx.image(path, f"step time per variant on {machine.tag}")]
        if ddp:
            ranked = sorted(ddp, key=lambda r: r.median_step_s)
            best, worst = ranked[0], ranked[-1]
            order = ", ".join(f"{r.variant} ({fmt.ms(r.median_step_s)} ms)" for r in ranked)
            extremes = fmt.compare(best.variant, best.median_step_s, worst.variant, worst.median_step_s)
            text += ["", f"From fastest to slowest: {order}. Fastest against slowest: {extremes}."]
        return "\n".join(text), [path]

    return ddp_section(ctx, "## All DDP variants: step time side by side",
                       "Every variant of each DDP step run, with the time spent in gradient synchronisation "
                       "after backward shaded in the plot.", body)
