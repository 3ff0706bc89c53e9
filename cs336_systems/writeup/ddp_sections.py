"""Problems 2 to 6a: equivalence of naive DDP, and the DDP step benchmark read variant by variant.

Every DDP-step section reads the same ``ddp_step*.json`` files (all variants were timed in
one interleaved run), picks the variants its problem is about, and compares them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from cs336_systems.writeup import fmt
from cs336_systems.writeup.ddp_analysis import Record, bucket_sweep, by_variant, comm_share
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import CPU, not_measured_notes, run_setting
from cs336_systems.writeup.ddp_figures import bucket_sweep_figure, step_time_figure
from cs336_systems.writeup.load import MachineResults, ResultsFile

BENCHMARK = "ddp_step"
COMPUTE_ONLY, TORCH_DDP = "compute-only", "torch-ddp"
COMBINED_TIMELINE = "timeline_overlap"  # the profiler's naive-above-per-parameter figure


# ---------------------------------------------------------------------------------------------
# Shared pieces


def ddp_setting_line(results: ResultsFile) -> str:
    """The setting of one DDP step run: hardware, backend, ranks, model, batch, steps."""
    meta = results.meta
    setting = meta.get("setting") or {}
    backend, device = ddp_run_setting(meta)
    n_params = meta.get("n_parameters")
    model = f"model {setting.get('model_size', '?')}"
    if n_params:
        model += f" ({fmt.sig(n_params / 1e6)}M parameters)"
    parts = [f"backend {backend}", f"world size {setting.get('world_size', meta.get('world_size', '?'))}", model,
             f"global batch {setting.get('global_batch', '?')} × context {setting.get('context_length', '?')}"]
    if setting.get("rounds") and setting.get("steps_per_round"):
        rounds = setting["rounds"]
        parts.append(f"{rounds * setting['steps_per_round']} timed steps per variant in {rounds} interleaved "
                     + ("round" if rounds == 1 else "rounds"))
    shared = bool(meta.get("shared_gpu")) or any(r.get("shared_gpu") for r in results.records)
    return fmt.setting_line(meta, results.source, device_type=device, parts=parts, shared_gpu=shared)


VARIANT_HEADERS = ["variant", "buckets", "all-reduce calls / step", "median step (ms)", "min–max (ms)",
                   "sync after backward (ms)", "sync share of step", "exposed overhead (ms)",
                   "its 95% interval (ms)", "tokens/s"]


def variant_row(r: Record) -> list:
    """Calls, step time and spread, sync phase and its share, exposed overhead, throughput."""
    calls = r.get("allreduce_calls_per_step")
    if r["variant"] == TORCH_DDP:
        sync_cell = share_cell = "inside backward"
    elif r["variant"] == COMPUTE_ONLY:
        sync_cell = share_cell = "–"
    else:
        sync_cell, share_cell = fmt.ms(r.get("median_sync_s")), fmt.pct(comm_share(r))
    return [
        r["variant"],
        "–" if r.get("n_buckets") is None else r["n_buckets"],
        "0" if r["variant"] == COMPUTE_ONLY else ("–" if calls is None else f"{calls:g}"),
        fmt.ms(r["median_step_s"]),
        f"{fmt.ms(r['min_step_s'])}–{fmt.ms(r['max_step_s'])}",
        sync_cell,
        share_cell,
        fmt.ms(r["exposed_overhead_s"]),
        "–" if r["variant"] == COMPUTE_ONLY else fmt.ms_interval(r.get("exposed_overhead_ci95_s")),
        fmt.sig(r["tokens_per_s"]),
    ]


def variant_table(records: Iterable[Record]) -> str:
    return fmt.table(VARIANT_HEADERS, [variant_row(r) for r in records])


def pick(records: list[Record], names: Iterable[str]) -> list[Record]:
    variants = by_variant(records)
    return [variants[n] for n in names if n in variants]


def _missing(variants: dict[str, Record], names: Iterable[str]) -> list[str]:
    return [n for n in names if n not in variants]


RunBody = Callable[[MachineResults, ResultsFile], tuple[str, list[Path]]]


def _ddp_section(ctx: RenderContext, heading: str, intro: str, body: RunBody) -> Section:
    """Heading, intro, then for each DDP run its setting and ``body(machine, results)``'s markdown."""
    out = [heading, "", intro]
    figures = []
    for machine, results in ctx.inputs.runs(BENCHMARK):
        text, figs = body(machine, results)
        out += ["", fmt.run_heading(machine, results), "", ddp_setting_line(results), "", text]
        figures += figs
    notes = not_measured_notes(ctx.inputs, BENCHMARK, "DDP step benchmark")
    if notes:
        out += ["", "### Not measured here", "", notes]
    return Section("\n".join(out), figures)


def _missing_text(missing: list[str]) -> str:
    return f"This run has no record of {', '.join(f'`{m}`' for m in missing)}."


# ---------------------------------------------------------------------------------------------
# Problem 2: naive DDP trains to single-process weights


def naive_ddp_section(ctx: RenderContext) -> Section:
    out = ["## naive_ddp: naive DDP against single-process training", "",
           "The same toy model, trained with naive DDP (gradients averaged by one all-reduce per parameter) "
           "and in one process on the whole batch, from the same initial weights and data; the table shows the "
           "largest absolute difference between any pair of corresponding parameters."]
    runs = ctx.inputs.runs("naive_ddp")
    for machine, results in runs:
        rows = []
        for r in results.records:
            per_step = r.get("max_abs_diff_per_step") or []
            rows.append([r.get("variant", "naive"), r.get("world_size"), r.get("steps"), r.get("batch_size"),
                         fmt.sig(r["max_abs_diff"]), fmt.sig(per_step[-1]) if per_step else "–",
                         f"{r.get('atol', 0):g}", "yes" if r.get("ranks_identical") else "no",
                         "**match**" if r.get("match") else "**MISMATCH**"])
        table = fmt.table(["variant", "ranks", "steps", "global batch", "max |DDP − single| over all steps",
                           "after the last step", "atol", "ranks bitwise identical", "verdict"], rows,
                          align="lrrrrrrll")
        sentences = []
        for r in results.records:
            verdict = "within" if r["max_abs_diff"] <= r.get("atol", 0) else "outside"
            sentences.append(
                f"After {r.get('steps')} steps on {r.get('world_size')} ranks, {r.get('variant', 'naive')} DDP's "
                f"parameters differ from single-process training by at most {fmt.sig(r['max_abs_diff'])}, "
                f"{verdict} the tolerance {r.get('atol', 0):g}; the ranks' parameters are "
                + ("bitwise identical." if r.get("ranks_identical") else "**not** identical.")
            )
        backend = results.meta.get("backend", "gloo")
        parts = [f"backend {backend}", f"world size {results.meta.get('world_size', '?')}"]
        out += ["", fmt.run_heading(machine, results), "",
                fmt.setting_line(results.meta, results.source, parts=parts), "", table, "", " ".join(sentences)]
    if not runs:
        out += ["", f"- Not measured here; `{CPU.command}` ({CPU.where}) fills it."]
    return Section("\n".join(out))


# ---------------------------------------------------------------------------------------------
# Problem 3: naive DDP's step time and communication share


def naive_benchmarking_section(ctx: RenderContext) -> Section:
    def body(machine, results):
        v = by_variant(results.records)
        missing = _missing(v, [COMPUTE_ONLY, "naive"])
        table = variant_table(pick(results.records, [COMPUTE_ONLY, "naive"]))
        if missing:
            return f"{table}\n\n{_missing_text(missing)}", []
        naive, floor = v["naive"], v[COMPUTE_ONLY]
        text = (
            f"Naive DDP's step takes {fmt.ms(naive['median_step_s'])} ms (median of {naive['steps_timed']} steps), "
            f"{fmt.ratio(naive['median_step_s'] / floor['median_step_s'])} the compute-only step "
            f"({fmt.ms(floor['median_step_s'])} ms). In the median step {fmt.pct(comm_share(naive))} of the time "
            f"goes to its {naive.get('allreduce_calls_per_step', 0):g} all-reduces after backward "
            f"({fmt.ms(naive['median_sync_s'])} ms, median); the exposed overhead (per round, step time minus "
            f"compute-only step time; median over rounds) is {fmt.ms(naive['exposed_overhead_s'])} ms "
            f"({fmt.pct(naive['exposed_share'])} of the step)."
        )
        return f"{table}\n\n{text}", []

    return _ddp_section(ctx, "## naive_ddp_benchmarking: naive DDP's step time and time communicating",
                        "Training steps of the benchmark model with naive DDP beside the same steps with no "
                        "communication at all (compute-only), timed in the same interleaved run.", body)


# ---------------------------------------------------------------------------------------------
# Problem 4: one flat all-reduce instead of one per parameter


def flat_benchmarking_section(ctx: RenderContext) -> Section:
    def body(machine, results):
        v = by_variant(results.records)
        table = variant_table(pick(results.records, [COMPUTE_ONLY, "naive", "flat"]))
        missing = _missing(v, ["naive", "flat"])
        if missing:
            return f"{table}\n\n{_missing_text(missing)}", []
        naive, flat = v["naive"], v["flat"]
        text = (
            f"Flat DDP makes {flat.get('allreduce_calls_per_step', 0):g} all-reduce call per step where naive makes "
            f"{naive.get('allreduce_calls_per_step', 0):g}: "
            + fmt.compare("flat", flat["median_step_s"], "naive", naive["median_step_s"])
            + f" per step, and its synchronisation after backward takes {fmt.ms(flat['median_sync_s'])} ms against "
            f"{fmt.ms(naive['median_sync_s'])} ms "
            f"({fmt.ratio(naive['median_sync_s'] / flat['median_sync_s'])} less time)."
        )
        return f"{table}\n\n{text}", []

    return _ddp_section(ctx, "## minimal_ddp_flat_benchmarking: one flat all-reduce against one per parameter",
                        "Naive DDP against flat DDP, which copies all gradients into one buffer and all-reduces it "
                        "with a single call (same run, same model).", body)


# ---------------------------------------------------------------------------------------------
# Problem 5: per-parameter overlap, with the profiler's timelines


def _profile_part(ctx: RenderContext, machine: MachineResults) -> tuple[list[str], list]:
    out, figures = [], []
    profile = machine.profile
    if profile is not None:
        meta = profile.meta
        setting = meta.get("setting") or {}
        backend, device = ddp_run_setting(meta)
        parts = [f"backend {backend}", f"world size {setting.get('world_size', meta.get('world_size', '?'))}",
                 f"model {setting.get('model_size', '?')}",
                 f"global batch {setting.get('global_batch', '?')} × context {setting.get('context_length', '?')}"]
        rows = [[r.get("variant"), fmt.pct(r.get("overlap_fraction")), fmt.ms(r.get("communication_s")),
                 fmt.ms(r.get("backward_s")), fmt.ms(r.get("step_s")), r.get("n_comm_events", "–"),
                 r.get("lanes_from", "–")] for r in profile.records]
        out += ["", f"#### Profile of one step on `{machine.tag}`", "",
                fmt.setting_line(meta, profile.source, device_type=device, parts=parts), "",
                fmt.table(["variant", "all-reduce time inside backward", "all-reduce time (ms)", "backward (ms)",
                           "step (ms)", "all-reduce events", "lanes from"], rows, align="lrrrrrl")]
        fractions = {r.get("variant"): r.get("overlap_fraction") for r in profile.records}
        if fractions.get("naive") is not None and fractions.get("per-parameter") is not None:
            out += ["", f"In the profiled step, {fmt.pct(fractions['per-parameter'])} of per-parameter DDP's "
                        f"all-reduce time lies inside backward, against {fmt.pct(fractions['naive'])} for naive DDP."]
    copies = {stem: ctx.copy_figure(png, f"{machine.tag}_profile_{stem}.png")
              for stem, png in machine.profile_images.items()}
    figures += copies.values()
    # The side-by-side timeline shows both variants on one time axis: embed it, link the rest.
    embedded = [COMBINED_TIMELINE] if COMBINED_TIMELINE in copies else list(copies)
    for stem in embedded:
        out += ["", ctx.image(copies[stem], f"{stem.replace('_', ' ')} on {machine.tag}")]
    linked = [stem for stem in copies if stem not in embedded]
    if linked:
        out += ["", "Each alone: " + ", ".join(f"[{stem}]({ctx.link(copies[stem])})" for stem in linked) + "."]
    return out, figures


def overlap_benchmarking_section(ctx: RenderContext) -> Section:
    def body(machine, results):
        v = by_variant(results.records)
        table = variant_table(pick(results.records, [COMPUTE_ONLY, "naive", "flat", "per-parameter"]))
        missing = _missing(v, ["naive", "flat", "per-parameter"])
        if missing:
            return f"{table}\n\n{_missing_text(missing)}", []
        pp = v["per-parameter"]
        text = (
            fmt.compare("Per-parameter DDP", pp["median_step_s"], "naive", v["naive"]["median_step_s"]) + "; "
            + fmt.compare("it", pp["median_step_s"], "flat", v["flat"]["median_step_s"])
            + f". What remains of its communication after backward is a wait of {fmt.ms(pp['median_sync_s'])} ms "
            f"(median), against naive's {fmt.ms(v['naive']['median_sync_s'])} ms of all-reduces after backward."
        )
        lines, figures = _profile_part(ctx, machine)
        return "\n".join([table, "", text, *lines]), figures

    heading = "## ddp_overlap_individual_parameters_benchmarking: overlapping each parameter's all-reduce"
    section = _ddp_section(ctx, heading,
                           "Per-parameter DDP starts each gradient's all-reduce from a hook as soon as backward "
                           "produces it; naive and flat wait for backward to end. The profiler's timelines (one "
                           "step, rank 0) show where the all-reduces fall relative to backward.", body)
    notes = not_measured_notes(ctx.inputs, "profile", "Profiler timelines")
    if notes:
        if "### Not measured here" not in section.markdown:
            section.markdown += "\n\n### Not measured here\n"
        section.markdown += "\n" + notes
    return section


# ---------------------------------------------------------------------------------------------
# Problem 6a: the bucket-size sweep


def bucketed_benchmarking_section(ctx: RenderContext) -> Section:
    def body(machine, results):
        sweep = bucket_sweep(results.records)
        references = pick(results.records, ["per-parameter", "flat", TORCH_DDP, COMPUTE_ONLY])
        sweep_table = fmt.table(["bucket size (MB)", *VARIANT_HEADERS],
                                [[fmt.size_mb(r["bucket_size_mb"]), *variant_row(r)] for r in sweep])
        if not sweep:
            return f"{variant_table(references)}\n\nThis run has no bucketed variant.", []
        model_size = (results.meta.get("setting") or {}).get("model_size", "")
        path = bucket_sweep_figure(sweep, {r["variant"]: r for r in references},
                                   f"bucket sweep, model {model_size} on {machine.tag}",
                                   ctx.figure_path(f"{machine.tag}_{results.name}_bucket_sweep.png"))
        best = min(sweep, key=lambda r: r["median_step_s"])
        worst = max(sweep, key=lambda r: r["median_step_s"])
        sentences = [
            f"Of the {len(sweep)} bucket sizes tried, {fmt.size_mb(best['bucket_size_mb'])} MB "
            f"({best.get('n_buckets')} buckets) gives the fastest step, {fmt.ms(best['median_step_s'])} ms, "
            f"{fmt.ratio(worst['median_step_s'] / best['median_step_s'])} faster than the slowest, "
            f"{fmt.size_mb(worst['bucket_size_mb'])} MB ({fmt.ms(worst['median_step_s'])} ms)."
        ]
        others = [r for r in references if r["variant"] != COMPUTE_ONLY]
        if others:
            parts = [fmt.relative(best["median_step_s"], r["variant"], r["median_step_s"]) for r in others]
            listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
            sentences.append(f"That step is {listed}.")
        lowest = min(sweep, key=lambda r: r["exposed_overhead_s"])
        interval = lowest.get("exposed_overhead_ci95_s")
        sentences.append(
            f"By exposed overhead, which pairs each step with the compute-only step of its own round and so "
            f"leaves out most of the machine's drift, the lowest is {fmt.size_mb(lowest['bucket_size_mb'])} MB's, "
            f"{fmt.ms(lowest['exposed_overhead_s'])} ms"
            + (f" (95% interval {fmt.ms_interval(interval)} ms)." if interval else ".")
        )
        text = "\n".join([sweep_table, "", "Other variants of the same run, for reference:", "",
                          variant_table(references), "", ctx.image(path, f"bucket sweep on {machine.tag}"), "",
                          " ".join(sentences)])
        return text, [path]

    return _ddp_section(ctx, "## ddp_bucketed_benchmarking: bucket size sweep",
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
        ddp = [r for r in records if r["variant"] != COMPUTE_ONLY]
        text = [variant_table(records), "", ctx.image(path, f"step time per variant on {machine.tag}")]
        if ddp:
            ranked = sorted(ddp, key=lambda r: r["median_step_s"])
            best, worst = ranked[0], ranked[-1]
            order = ", ".join(f"{r['variant']} ({fmt.ms(r['median_step_s'])} ms)" for r in ranked)
            extremes = fmt.compare(best["variant"], best["median_step_s"], worst["variant"], worst["median_step_s"])
            text += ["", f"From fastest to slowest: {order}. Fastest against slowest: {extremes}."]
        return "\n".join(text), [path]

    return _ddp_section(ctx, "## All DDP variants: step time side by side",
                        "Every variant of each DDP step run, with the time spent in gradient synchronisation "
                        "after backward shaded in the plot.", body)
