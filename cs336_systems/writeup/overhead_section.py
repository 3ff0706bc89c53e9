"""ddp_bucketed_benchmarking (b): the overhead model, fitted to the all-reduce runs and checked on the bucket sweep.

Numbers only: the derivation and every sentence are in ``templates/details/overhead_model.md.j2`` and
``templates/answers/ddp_bucketed_benchmarking_b.md.j2``. Inputs: the ``allreduce`` fits (allreduce_analysis.py),
the naive variant's backward in ``profile.json`` and each ``ddp_step`` run's bucket sweep, same machine.
Everything drawn passes through :func:`settled` and the bucket axis through :func:`log_scale`, so the
figure's bytes do not depend on the CPU's rounding.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from cs336_systems.bench.family.record import FamilyRecord
from cs336_systems.bench.profile.record import ProfileRecord
from cs336_systems.bench.step.variants import TORCH_DDP
from cs336_systems.ddp.auto_bucket import CALIBRATION_ITERS, CALIBRATION_PAYLOAD_BYTES
from cs336_systems.ddp.overhead_model import minimum_exposed_overhead, optimal_bucket_bytes
from cs336_systems.writeup import coverage, fmt, templating
from cs336_systems.writeup.context import Page, RenderContext, details_link
from cs336_systems.writeup.ddp_analysis import (STEP_KIND, OverheadPrediction, bucket_sweep, by_variant,
                                                core_time_taken, largest_parameter_bytes, predict_overhead, step_runs)
from cs336_systems.writeup.figures import error_bars, log_scale, save
from cs336_systems.writeup.load import MachineResults, ResultsFile
from cs336_systems.writeup.allreduce_analysis import FIT_HEADERS, fit_for_run, fit_row, machine_fits, drawn_ms as _ms

RATIO_BAND = 0.30  # predicted / measured within 1 ± this counts as the model holding


def profiled_backward(machine: MachineResults, results: ResultsFile) -> tuple[float, float | None, str] | None:
    """(backward alone, backward beside per-parameter DDP's all-reduces, the profile's file): medians over the
    profiled steps of the same machine, backend, ranks and workload; None without such a profile."""
    env = results.environment
    for f in machine.runs(ProfileRecord.KIND, like=results):
        if (f.environment.backend, f.environment.device_type, f.environment.world_size) != (
                env.backend, env.device_type, env.world_size):
            continue
        seconds = {r.variant: statistics.median(t.backward_us for t in r.timelines) * 1e-6 for r in f.records}
        if "naive" in seconds:
            return seconds["naive"], seconds.get("per-parameter"), f.source
    return None


def _band(pairs: list[tuple[float, float]]) -> dict | None:
    """Ratios (bucket size, predicted / measured): their range and the sizes outside 1 ± RATIO_BAND."""
    return pairs and dict(low=min(v for _, v in pairs), high=max(v for _, v in pairs),
                          outside=[(size, v) for size, v in pairs if abs(v - 1) > RATIO_BAND])


def overhead_figure(p: OverheadPrediction, torch_ddp, title: str, path: Path) -> Path:
    """Measured exposed overhead and wait against the bucket cap, beside the recursion, the closed form
    and the channel's busy time (bars: 95% intervals), torch's DDP at 25 MB; every value settled."""
    fig = Figure(figsize=(7.5, 5.0))
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.27, top=0.93)
    ax = fig.subplots()
    records = [row.record for row in p.rows]
    x = np.array([r.bucket_size_mb for r in records], dtype=float)

    def bars(values, intervals):
        return error_bars(values, _ms(i[0] for i in intervals), _ms(i[1] for i in intervals)) if all(intervals) else None

    exposed = _ms(r.exposed_overhead_s for r in records)
    ax.errorbar(x, exposed, yerr=bars(exposed, [r.exposed_overhead_ci95_s for r in records]), fmt="o", capsize=3,
                color="black", label="measured exposed overhead (step − compute-only; bars: 95% interval)")
    for values, marker, style, label in (
            ([r.median_sync_s for r in records], "s", dict(color="tab:gray"), "measured wait after backward"),
            ([row.wait_s for row in p.rows], "^-", dict(color="tab:red"), "predicted wait (recursion, buckets as built)"),
            ([row.closed_form_s for row in p.rows], "v", dict(color="tab:red", fillstyle="none"),
             "closed form o n_b + s/(w n_b) at the buckets built")):
        shown = [(xi, v) for xi, v in zip(x, values) if v is not None]
        ax.plot([a for a, _ in shown], _ms(v for _, v in shown), marker, label=label, **style)
    channel = _ms(row.channel_s for row in p.rows)
    ax.errorbar(x * 1.12, channel, yerr=bars(channel, [row.channel_range_s for row in p.rows]), fmt="x--", capsize=3,
                color="tab:green", label="channel busy n_b o + s/w, nothing hidden (bars: o's and w's 95% intervals)")
    if torch_ddp is not None:
        ax.plot([25.0], _ms([torch_ddp.exposed_overhead_s]), "D", color="tab:purple",
                label="torch DDP, measured exposed overhead (25 MB buckets)")
    log_scale(ax, "x")
    ax.set(xlabel="bucket cap (MB)", ylabel="time per step (ms)", title=title)
    ax.set_ylim(bottom=min(0.0, float(exposed.min()) * 1.1))  # from 0, lower only for a negative median
    ax.margins(x=0.08)
    ax.grid(True, alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="lower center", ncols=2)
    return save(fig, path)


def _prediction(ctx: RenderContext, machine: MachineResults, results: ResultsFile) -> dict:
    env, setting = results.environment, results.setting
    out = dict(tag=machine.tag, heading=fmt.run_heading(machine, results).replace("###", "####"),
               setting=fmt.workload_setting_line(results), env=env, command=coverage.GPU.command
               if env.device_type == "cuda" else coverage.CPU.command, why=None, p=None)
    g = fit_for_run(machine, results)
    records = results.records
    n_parameters, sweep = results.notes.get("n_parameters"), bucket_sweep(records)
    if env.world_size == 1 or g is None or isinstance(g.fit, str) or not n_parameters or not sweep:
        return {**out, "why": "one rank" if env.world_size == 1 else "no fit" if g is None else
                g.fit if isinstance(g.fit, str) else "no sweep"}
    backward = profiled_backward(machine, results)
    p_max = largest_parameter_bytes(setting.get("model_size", ""), setting.get("context_length"))
    p = predict_overhead(n_parameters, p_max, g.fit, sweep, backward[0] if backward else None, g.intervals)
    if isinstance(p, str):
        return {**out, "why": p}
    rows = [[row.record.variant, row.record.n_buckets, fmt.ms(row.closed_form_s), fmt.ms(row.wait_s),
             fmt.ms(row.record.median_sync_s), f"{fmt.ms(row.channel_s)} ({fmt.ms_interval(row.channel_range_s)})",
             f"{fmt.ms(row.record.exposed_overhead_s)} ({fmt.ms_interval(row.record.exposed_overhead_ci95_s)})"]
            for row in p.rows]
    flat, threads = by_variant(records).get("flat"), results.notes.get("threads_per_rank")
    path = overhead_figure(p, by_variant(records).get(TORCH_DDP), f"overhead model vs bucket sweep on "
                           f"{machine.tag}", ctx.figure_path(f"{machine.tag}_{results.name}_overhead_model.png"))
    size = lambda row: fmt.size_mb(row.record.bucket_size_mb)  # noqa: E731
    return {**out, "p": p, "fit": g.fit, "iv": g.intervals, "p_max": p_max, "backward": backward,
            "fitted": g.records, "auto": _auto_calibration(machine, p.s_bytes), "spans": _optimum_spans(p, g.intervals),
            "threads": threads,
            "core": core_time_taken(records, setting.get("steps_per_round") or 1),
            "cores_shared": env.device_type == "cpu" and bool(env.cpu_count and threads)
            and env.world_size * threads >= env.cpu_count,
            "n_slower": sum(p.backward_s >= row.channel_s for row in p.rows) if p.backward_s else None,
            "channel_range": (min(r.channel_s for r in p.rows), max(r.channel_s for r in p.rows)),
            "waits": _band([(size(row), row.wait_s / row.record.median_sync_s) for row in p.rows
                            if row.wait_s is not None and row.record.median_sync_s]),
            "channel": _band([(size(row), row.channel_s / row.record.exposed_overhead_s) for row in p.rows
                              if row.record.exposed_overhead_s > 0]),
            "hidden": [row.record.exposed_overhead_s - row.record.median_sync_s for row in p.rows
                       if row.record.median_sync_s is not None],
            "behind": [(size(row), row.record.median_sync_s - row.wait_s) for row in p.rows
                       if row.wait_s is not None and row.record.median_sync_s
                       and row.record.median_sync_s > row.wait_s * (1 + RATIO_BAND)],
            "flat": flat and flat.median_sync_s and dict(
                sync=flat.median_sync_s, alone=p.o_s + p.s_bytes / p.fit.w_bytes_per_s,
                copies=statistics.median(flat.pack_times_s) + statistics.median(flat.unpack_times_s)
                if flat.pack_times_s and flat.unpack_times_s else None),
            "table": fmt.table(["variant", "buckets n_b", "closed form T(n_b) (ms)", "recursion: predicted wait (ms)",
                                "measured wait after backward (ms)", "channel busy n_b o + s/w (ms; o, w intervals)",
                                "measured exposed overhead (ms; 95% interval)"], rows),
            "figure": path, "image": ctx.image(path, f"overhead model against the bucket sweep on {machine.tag}")}


def _optimum_spans(p: OverheadPrediction, iv) -> dict | None:
    """b_opt and T over the corners of o's and w's 95% intervals, beside the measured waits after backward
    (what T, the closed form's wait at its optimum, is to be compared with); None without intervals."""
    waits = [row.record.median_sync_s for row in p.rows if row.record.median_sync_s]
    if iv is None or not waits:
        return None
    (o_low, o_high), (w_low, w_high) = (max(iv.o_s[0], 0.0), max(iv.o_s[1], 0.0)), iv.w_bytes_per_s
    p_max = p.largest_param_bytes or 1.0
    return dict(b_opt=(optimal_bucket_bytes(p.s_bytes, w_low, o_low, p_max),
                       optimal_bucket_bytes(p.s_bytes, w_high, o_high, p_max)),
                t_opt=(minimum_exposed_overhead(p.s_bytes, w_high, o_low),
                       minimum_exposed_overhead(p.s_bytes, w_low, o_high)),
                waits=(min(waits), max(waits)), ratios=(min(waits) / p.t_opt_s, max(waits) / p.t_opt_s))


def _auto_calibration(machine: MachineResults, s_bytes: float) -> dict | None:
    """``bucket_size_mb="auto"``'s own fit on the same model (the family run's model whose gradients are
    ``s_bytes``), to set beside the benchmark's: both fit o + b/w, on different payloads."""
    found = next((r for f in machine.runs(FamilyRecord.KIND) for r in f.records
                  if abs(r.gradient_bytes - s_bytes) < 1), None)
    if found is None:
        return None
    return dict(record=found, payloads=CALIBRATION_PAYLOAD_BYTES, iters=CALIBRATION_ITERS)


def overhead_page(ctx: RenderContext) -> Page:
    fits = [dict(tag=m.tag, setting=fmt.setting_line(m.runs("allreduce")[0].environment, "`, `".join(
                 r.source for r in m.runs("allreduce"))), table=fmt.table(FIT_HEADERS, [fit_row(g) for g in gs]),
                 w_above=[g.group.label for g in gs if not isinstance(g.fit, str)
                          and g.fit.w_bytes_per_s > max(r.algbw_gbps for r in g.records) * 1e9])
            for m in ctx.inputs.machines if m.runs("allreduce") for gs in [machine_fits(m)] if gs]
    runs = [_prediction(ctx, m, f) for m, f in step_runs(ctx.inputs)]
    missing = [s.name for s in coverage.note_gaps(ctx, "allreduce", "the fit of o and w (all-reduce benchmark)")
               + coverage.note_gaps(ctx, STEP_KIND, "the bucket sweep the model is checked on (DDP step benchmark)",
                                    runs=[f for _, f in step_runs(ctx.inputs)])]
    values = dict(fits=fits, runs=runs, missing=sorted(set(missing)), band=RATIO_BAND, link=details_link(
        "overhead_model"), gaps=details_link("machines", "not-measured-here"), family=details_link("auto_bucket"))
    answer = templating.render("answers/ddp_bucketed_benchmarking_b.md.j2", **values)
    markdown = templating.render("details/overhead_model.md.j2", **{**values, "gaps": "machines.md#not-measured-here",
                                                                    "family": "auto_bucket.md"})
    return Page("overhead_model", markdown, {"ddp_bucketed_benchmarking": answer},
                [r["figure"] for r in runs if r["p"]])
