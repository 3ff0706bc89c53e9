"""Problem 6b: the bucketed-DDP overhead model, derived, fitted to our all-reduce runs, and checked.

The derivation is prose and algebra (no numbers); everything after it is computed from the
``allreduce*.json`` fits (overhead_fit.py), the naive variant's backward in ``profile.json`` and
the ``ddp_step*.json`` bucket sweep of the same machine and workload.
"""

from __future__ import annotations

import statistics

from cs336_systems.bench.profile.record import ProfileRecord
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import TORCH_DDP
from cs336_systems.writeup import fmt
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import CPU, GPU, not_measured_notes
from cs336_systems.writeup.ddp_analysis import (
    FLOAT32_BYTES,
    OverheadPrediction,
    bucket_sweep,
    by_variant,
    largest_parameter_bytes,
    predict_overhead,
    step_runs,
)
from cs336_systems.writeup.ddp_figures import overhead_model_figure
from cs336_systems.writeup.load import MachineResults, ResultsFile
from cs336_systems.writeup.overhead_derivation import DERIVATION
from cs336_systems.writeup.overhead_fit import GroupFit, fit_part, machine_fits
from cs336_systems.writeup.step_tables import ddp_setting_line, step_not_measured

RATIO_BAND = 0.30  # predicted / measured within 1 ± this counts as the model holding
WORKLOAD_KEYS = ("model_size", "context_length", "global_batch")  # what a profile must share with a step run


def _run_fit(machine: MachineResults, results: ResultsFile) -> GroupFit | None:
    """The machine's fit for the run's backend, device, world size and GPU sharing (None: not measured)."""
    env = results.environment
    for g in machine_fits(machine):
        if (g.group.backend, g.group.device_type, g.group.world_size, g.group.shared_gpu) == (
                env.backend, env.device_type, env.world_size, env.shared_gpu):
            return g
    return None


def profiled_backward(machine: MachineResults, results: ResultsFile) -> tuple[float, float | None, str] | None:
    """(backward alone, backward beside per-parameter DDP's all-reduces, the profile's source), medians
    over the profiled steps of the same machine, backend, ranks and workload; None without one."""
    env = results.environment
    for f in machine.runs(ProfileRecord.KIND):
        fe = f.environment
        if (fe.backend, fe.device_type, fe.world_size) != (env.backend, env.device_type, env.world_size):
            continue
        if any(f.setting.get(k) != results.setting.get(k) for k in WORKLOAD_KEYS):
            continue
        by = {r.variant: r for r in f.records}
        if "naive" not in by:
            continue
        seconds = {v: statistics.median(t.backward_us for t in r.timelines) * 1e-6 for v, r in by.items()}
        return seconds["naive"], seconds.get("per-parameter"), f.source
    return None


def _in_band(ratio: float) -> bool:
    return abs(ratio - 1) <= RATIO_BAND


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b > 0 else None


def _prediction_table(p: OverheadPrediction) -> str:
    rows = []
    for row in p.rows:
        r = row.record
        last = r.bucket_bytes[-1] if r.bucket_bytes else None
        wait_ratio, channel_ratio = _ratio(row.wait_s, r.median_sync_s), _ratio(row.channel_s, r.exposed_overhead_s)
        gap = None if r.median_sync_s is None else r.exposed_overhead_s - r.median_sync_s
        rows.append([r.variant, fmt.size_mb(r.bucket_size_mb), r.n_buckets, fmt.mb(last), fmt.ms(row.closed_form_s),
                     fmt.ms(row.wait_s), fmt.ms(r.median_sync_s), fmt.ratio(wait_ratio) if wait_ratio else "–",
                     fmt.ms(row.channel_s), fmt.ms_interval(row.channel_range_s), fmt.ms(r.exposed_overhead_s),
                     fmt.ms_interval(r.exposed_overhead_ci95_s),
                     fmt.ratio(channel_ratio) if channel_ratio else "–", fmt.ms(gap)])
    return fmt.table(["variant", "bucket cap (MB)", "buckets n_b", "last bucket (MB)", "closed form T(n_b) (ms)",
                      "recursion: predicted wait after backward (ms)", "measured wait after backward (ms)",
                      "predicted / measured wait", "channel busy, n_b o + s/w (ms)",
                      "over o's and w's 95% intervals (ms)", "measured exposed overhead (ms)",
                      "its 95% interval (ms)", "channel busy / measured exposed", "exposed − wait (ms)"], rows)


def _band_sentence(what: str, ratios: list[tuple[StepRecord, float]]) -> str:
    if not ratios:
        return ""
    values = [v for _, v in ratios]
    outside = [f"{fmt.size_mb(r.bucket_size_mb)} MB ({fmt.ratio(v)})" for r, v in ratios if not _in_band(v)]
    text = f"{what} runs from {fmt.ratio(min(values))} to {fmt.ratio(max(values))}: "
    if not outside:
        return text + f"within ±{fmt.pct(RATIO_BAND, 2)} at every bucket size of the sweep."
    return text + f"outside ±{fmt.pct(RATIO_BAND, 2)} at " + ", ".join(outside) + "."


def _uncertain_sizes(p: OverheadPrediction, smallest_payload_mb: float) -> str:
    """Where the channel-busy prediction misses the band, whether o's and w's own uncertainty covers the miss."""
    covered, missed = [], []
    for row in p.rows:
        r, span = row.record, row.channel_range_s
        if span is None or r.exposed_overhead_s <= 0 or _in_band(row.channel_s / r.exposed_overhead_s):
            continue
        (covered if span[0] <= r.exposed_overhead_s <= span[1] else missed).append(
            f"{fmt.size_mb(r.bucket_size_mb)} MB ({r.n_buckets} calls: {fmt.ms_interval(span)} ms against "
            f"{fmt.ms(r.exposed_overhead_s)} ms measured)")
    text = ""
    if covered:
        text += ("Over the 95% intervals of $o$ and $w$ the channel-busy prediction covers the measurement at "
                 + ", ".join(covered) + ": with many calls, the uncertainty of the per-call cost, extrapolated from "
                 f"payloads of {fmt.size_mb(smallest_payload_mb)} MB and up, is multiplied by the bucket count.")
    if missed:
        lead = "It does not at " if covered else "Even over the 95% intervals of $o$ and $w$ the channel-busy prediction misses at "
        text += (" " if text else "") + lead + ", ".join(missed) + "."
    return text


def cores_shared(results: ResultsFile) -> bool:
    """Whether compute leaves no core idle for gloo's threads (CPU, ranks x threads >= cores)."""
    env, threads = results.environment, results.notes.get("threads_per_rank")
    return env.device_type == "cpu" and bool(env.cpu_count and threads) and env.world_size * threads >= env.cpu_count


def _regime(p: OverheadPrediction) -> str:
    if p.backward_s is None:
        return ""
    slower = [row for row in p.rows if p.backward_s >= row.channel_s]
    channels = [row.channel_s for row in p.rows]
    span = f"{fmt.ms(min(channels))} to {fmt.ms(max(channels))} ms"
    if len(slower) == len(p.rows):
        return (f"**Compute-bound here**: backward computes for {fmt.ms(p.backward_s)} ms, longer than the channel "
                f"needs for all buckets ($n_b\\,o + s/w$: {span} over the sweep), so each bucket finds the channel "
                "free or nearly, and the predicted wait is about the last bucket's own transfer.")
    if not slower:
        return (f"**Communication-bound here**: backward computes for {fmt.ms(p.backward_s)} ms, less than the "
                f"channel needs for all buckets ($n_b\\,o + s/w$: {span}), so buckets queue behind each other.")
    return (f"Backward computes for {fmt.ms(p.backward_s)} ms against a channel busy for {span}: compute-bound at "
            f"{len(slower)} of the {len(p.rows)} bucket sizes, communication-bound at the others.")


def _left_out(p: OverheadPrediction, results: ResultsFile, backward: tuple[float, float | None, str] | None) -> list[str]:
    """What the model leaves out, each with the measurement that sizes it."""
    reasons = []
    env, threads = results.environment, results.notes.get("threads_per_rank")
    gaps = [row.record.exposed_overhead_s - row.record.median_sync_s for row in p.rows
            if row.record.median_sync_s is not None]
    if gaps:
        text = ("**Compute slowed by the communication beside it.** The recursion predicts the wait after backward; "
                "the exposed overhead is the whole step against the compute-only step, so it also counts forward, "
                "backward and the optimizer step running slower while all-reduces run beside them: *exposed − wait*, "
                f"from {fmt.ms(min(gaps))} to {fmt.ms(max(gaps))} ms over the sweep.")
        if cores_shared(results):
            text += (f" Here {env.world_size} ranks × {threads} compute thread{'s' if threads != 1 else ''} fill the "
                     f"{env.cpu_count} cores and gloo reduces on CPU threads, so an all-reduce during backward is not "
                     "hidden: it takes its core time from backward. The step then pays about the channel's whole busy "
                     "time, $n_b\\,o + s/w$, whatever the bucketing: the *channel busy* column.")
        reasons.append(text)
    behind = [(row.record, row.record.median_sync_s - row.wait_s) for row in p.rows
              if row.wait_s is not None and row.record.median_sync_s and not _in_band(row.wait_s / row.record.median_sync_s)
              and row.record.median_sync_s > row.wait_s]
    if behind:
        reasons.append(
            "**A channel busier at the end of backward than the recursion expects.** The measured wait is longer "
            "than the recursion's by " + ", ".join(f"{fmt.ms(extra)} ms at {fmt.size_mb(r.bucket_size_mb)} MB" for r, extra in behind)
            + ": more was still on the channel when backward ended. It ran slower during backward than timed alone "
            "(sharing the cores with it), and the last gradients come closer together than a constant byte rate "
            "says (an embedding's gradient is large but costs backward no matmul).")
    if backward and backward[1] is not None:
        alone, beside, source = backward
        text = (f"The profiler (`{source}`) shows backward computing for {fmt.ms(alone)} ms with nothing beside it "
                f"(naive DDP) and for {fmt.ms(beside)} ms beside per-parameter DDP's all-reduces "
                f"({fmt.ratio(beside / alone)})")
        if beside < alone:
            text += (": shorter with more to do, which only drift between the two profiled runs (profiled one "
                     "after the other, not interleaved) explains, so the profile does not size this effect here.")
        else:
            text += f", {fmt.ms(beside - alone)} ms lost to the communication beside it."
        reasons.append(text)
    flat = by_variant(results.records).get("flat")
    if flat and flat.median_sync_s:
        alone_s = p.o_s + p.s_bytes / p.fit.w_bytes_per_s
        copies = (statistics.median(flat.pack_times_s) + statistics.median(flat.unpack_times_s)
                  if flat.pack_times_s and flat.unpack_times_s else None)
        text = (f"**The channel inside a step against the channel timed alone.** Flat DDP's one all-reduce of all "
                f"{fmt.mb(p.s_bytes)} MB after backward (nothing computing beside it) takes {fmt.ms(flat.median_sync_s)} "
                f"ms against $o + s/w$ = {fmt.ms(alone_s)} ms from all-reduces timed on their own "
                f"({fmt.ratio(flat.median_sync_s / alone_s)})")
        if copies is not None:
            text += (f"; {fmt.ms(copies)} ms of it are its copies into the flat buffer and back (timed beside its "
                     f"steps), leaving {fmt.ms(flat.median_sync_s - copies)} ms for the all-reduce "
                     f"({fmt.ratio((flat.median_sync_s - copies) / alone_s)})")
        reasons.append(text + ".")
    return reasons


def _prediction_part(ctx: RenderContext, machine: MachineResults, results: ResultsFile) -> tuple[list[str], list]:
    env, setting = results.environment, results.setting
    out = ["", fmt.run_heading(machine, results).replace("###", "####"), "", ddp_setting_line(results)]
    if env.world_size == 1:
        return out + ["", "One rank communicates nothing: there is no overhead to model in this run."], []
    g = _run_fit(machine, results)
    if g is None:
        command = GPU.command if env.device_type == "cuda" else CPU.command
        return out + ["", f"The all-reduce benchmark on `{machine.tag}` has no {env.backend} line with "
                          f"{env.world_size} ranks on {env.device_type}: **not measured here**; `{command}` fills it."], []
    if isinstance(g.fit, str):
        return out + ["", f"No fit for {env.backend} with {env.world_size} ranks: {g.fit}."], []
    n_parameters, sweep = results.notes.get("n_parameters"), bucket_sweep(results.records)
    if not n_parameters or not sweep:
        return out + ["", "This run lacks the parameter count or a bucket sweep; nothing to predict."], []
    model_size = setting.get("model_size", "")
    p_max = largest_parameter_bytes(model_size, setting.get("context_length"))
    backward = profiled_backward(machine, results)
    p = predict_overhead(n_parameters, p_max, g.fit, sweep, backward[0] if backward else None, g.intervals)
    if isinstance(p, str):
        return out + ["", f"No prediction: {p}."], []
    fit, iv = g.fit, g.intervals
    spread = lambda pair, show, unit: f" (95% interval {show(pair[0])} to {show(pair[1])} {unit})"  # noqa: E731
    out += ["",
            f"- $s$ = {FLOAT32_BYTES} bytes × {n_parameters} parameters = {fmt.mb(p.s_bytes)} MB"
            + (f"; the largest parameter of `{model_size}` is $p_{{\\max}}$ = {fmt.mb(p_max)} MB." if p_max else "."),
            f"- fit for {env.backend}, {env.world_size} ranks on {env.device_type}: $o$ = {fmt.us(fit.o_s)} µs"
            + (spread(iv.o_s, fmt.us, "µs") if iv else "") + f", $w$ = {fmt.gbps(fit.w_bytes_per_s)} GB/s"
            + (spread(iv.w_bytes_per_s, fmt.gbps, "GB/s") if iv else "") + "."
            + (" The fitted $o$ is negative, a per-call cost below what these payloads resolve: the model uses "
               "$o$ = 0, as `bucket_size_mb=\"auto\"` does." if fit.o_s < 0 else ""),
            f"- closed form: $n_b^\\ast$ = {fmt.sig(p.n_b_opt)}, $b_{{\\mathrm{{opt}}}} = \\min(\\sqrt{{s\\,w\\,o}}, s)$ = "
            f"**{fmt.mb(p.b_opt_bytes)} MB**, $T(n_b^\\ast) = 2\\sqrt{{s\\,o/w}}$ = {fmt.ms(p.t_opt_s)} ms.",
            "- backward: " + (f"{fmt.ms(backward[0])} ms, the naive variant's backward (no communication beside it), "
                              f"median over its profiled steps in `{backward[2]}`." if backward else
                              "no profile of this workload on this machine, so the recursion has no $B$: "
                              f"**not measured here**; `{CPU.command if env.device_type == 'cpu' else GPU.command}` "
                              "fills it."),
            "", _regime(p), "",
            "The recursion runs on each variant's buckets as built (payloads in launch order, recorded by the step "
            "benchmark); *measured wait after backward* is the median time in `finish_gradient_synchronization`, the "
            "quantity the model predicts; *exposed overhead* is the step minus the compute-only step of the same "
            "round (median, with its 95% interval).", "", _prediction_table(p)]
    torch_ddp = by_variant(results.records).get(TORCH_DDP)
    path = overhead_model_figure(p, torch_ddp, f"overhead model vs bucket sweep on {machine.tag}",
                                 ctx.figure_path(f"{machine.tag}_{results.name}_overhead_model.png"))
    waits = [(row.record, row.wait_s / row.record.median_sync_s) for row in p.rows
             if row.wait_s is not None and row.record.median_sync_s]
    channel = [(row.record, row.channel_s / row.record.exposed_overhead_s) for row in p.rows
               if row.record.exposed_overhead_s > 0]
    sentences = [s for s in (_band_sentence("Predicted / measured wait after backward", waits),
                             _band_sentence("Channel busy time / measured exposed overhead", channel),
                             _uncertain_sizes(p, g.records[0].payload_mb)) if s]
    out += ["", ctx.image(path, f"overhead model against the measured bucket sweep on {machine.tag}"), "",
            " ".join(sentences), "", "What the model leaves out, measured:", "",
            *[f"- {r}" for r in _left_out(p, results, backward)]]
    return out, [path]


def _regimes_note(ctx: RenderContext) -> str:
    """The communication-bound regime, where no run measures it."""
    gpu_runs = [f for _, f in step_runs(ctx.inputs) if f.environment.device_type == "cuda" and f.environment.world_size > 1]
    if gpu_runs:
        return ""
    return ("- Communication-bound regime (a GPU's backward, far faster than the channel: gloo ranks sharing one "
            f"GPU, or NCCL between GPUs): **not measured here**; `{GPU.command}` fills it (on one GPU, gloo ranks "
            "sharing it; on 2–6 GPUs, NCCL).")


def overhead_model_section(ctx: RenderContext) -> Section:
    out = ["## ddp_bucketed_benchmarking (b): a model of the overhead, and the best bucket size", "", DERIVATION, ""]
    out += fit_part(ctx)
    out += ["", "### Predicted against measured", "",
            "For each DDP step run, the fit of the same backend and world size on the same machine, $s$ from the "
            "run's parameter count, the buckets each bucketed variant built, and backward's length from the "
            "profile of the same workload."]
    figures = []
    for machine, results in step_runs(ctx.inputs):
        lines, figs = _prediction_part(ctx, machine, results)
        out += lines
        figures += figs
    notes = [not_measured_notes(ctx.inputs, "allreduce", "Fit of $o$ and $w$ (all-reduce benchmark)"),
             step_not_measured(ctx, "Bucket sweep to compare with (DDP step benchmark)"), _regimes_note(ctx)]
    notes = [n for n in notes if n]
    if notes:
        out += ["", "### Not measured here", "", *notes]
    return Section("\n".join(out), figures)
