"""Beyond the handout: the bucketed-DDP lever ablation (``ddp_step-ablation.json``), timed beside torch's DDP.

The ablation is a run of the DDP step benchmark (``scripts/bench_ddp.py --ablation``) with
:data:`~cs336_systems.bench.step.variants.ABLATION_VARIANTS`. Numbers only; the words are in
``templates/details/ablation.md.j2``. Every comparison is a paired difference (:mod:`.paired`), and the
page counts them, so that one resolved difference among many is read as what it may be: chance.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import COMPUTE_ONLY, TORCH_DDP, communication_dtype
from cs336_systems.units import MB
from cs336_systems.writeup import coverage, fmt, templating
from cs336_systems.writeup.context import Page, RenderContext
from cs336_systems.writeup.ddp_analysis import STEP_KIND, ablation_runs, by_variant
from cs336_systems.writeup.figures import error_bars, save
from cs336_systems.writeup.overhead_fit import settle, settled
from cs336_systems.writeup.paired import paired, signed_ms

DEFAULT, BF16, NO_FIRST = "bucketed-25MB", "bucketed-25MB-bf16", "bucketed-25MB-no-first"
# (lever, the variant with that lever alone switched off), compared with the default.
LEVER_OFF = (("gradient views", "bucketed-25MB-copy"), ("first-bucket cap", NO_FIRST),
             ("rebuild in ready order", "bucketed-25MB-no-reorder"), ("all three levers", "bucketed-25MB-plain"))


def _ms(values) -> np.ndarray:
    return np.array([settled(v * 1e3) for v in values])


def exposed_overhead_figure(records: list[StepRecord], title: str, path: Path) -> Path:
    """Exposed overhead per variant (bars: 95% intervals), torch DDP's as a line and band; every value settled."""
    shown = [r for r in records if r.variant not in (COMPUTE_ONLY, TORCH_DDP)]
    torch_ddp = next((r for r in records if r.variant == TORCH_DDP), None)
    height = 0.42 * len(shown) + 1.9
    fig = Figure(figsize=(8.0, height))
    fig.subplots_adjust(left=0.26, right=0.97, bottom=1.0 / height, top=1 - 0.35 / height)
    ax = fig.subplots()
    y = np.arange(len(shown))[::-1]
    values, intervals = _ms(r.exposed_overhead_s for r in shown), [r.exposed_overhead_ci95_s for r in shown]
    errors = (error_bars(values, _ms(i[0] for i in intervals), _ms(i[1] for i in intervals))
              if all(intervals) else None)
    ax.barh(y, values, xerr=errors, capsize=3, color="tab:blue", alpha=0.7,
            label="exposed overhead (median over rounds of step − compute-only step; bars: 95% interval)")
    if torch_ddp is not None:
        ax.axvline(_ms([torch_ddp.exposed_overhead_s])[0], color="tab:red", ls="--",
                   label=f"torch DDP ({fmt.ms(torch_ddp.exposed_overhead_s)} ms)")
        if torch_ddp.exposed_overhead_ci95_s:
            ax.axvspan(*_ms(torch_ddp.exposed_overhead_ci95_s), color="tab:red", alpha=0.12,
                       label="torch DDP's 95% interval")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(y, [r.variant for r in shown])
    ax.set(xlabel="exposed overhead per step (ms)", title=title)
    ax.grid(True, axis="x", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="lower center", ncols=2)
    return save(fig, path)


def _first_buckets(default: StepRecord | None, no_first: StepRecord | None) -> dict | None:
    """The first bucket with the first-bucket cap on and off, from the buckets each variant built."""
    if not (default and no_first and default.bucket_params and no_first.bucket_params and default.bucket_bytes
            and no_first.bucket_bytes):
        return None
    on, off = default.bucket_params[0], no_first.bucket_params[0]
    return dict(on=on, off=off, on_bytes=default.bucket_bytes[0], off_bytes=no_first.bucket_bytes[0],
                cap=default.first_bucket_cap_bytes, extra=[n for n in off if n not in on],
                extra_bytes=no_first.bucket_bytes[0] - default.bucket_bytes[0], n_on=default.n_buckets,
                n_off=no_first.n_buckets, same_later=default.bucket_params[1:] == no_first.bucket_params[1:])


def _run(ctx: RenderContext, machine, results) -> dict:
    records: list[StepRecord] = settle(results.records)
    v = by_variant(records)
    floor, torch_ddp, default, bf16 = v.get(COMPUTE_ONLY), v.get(TORCH_DDP), v.get(DEFAULT), v.get(BF16)
    against = {r.variant: paired(r, torch_ddp) for r in records
               if torch_ddp is not None and r.variant not in (COMPUTE_ONLY, TORCH_DDP)}
    levers = [(lever, paired(v[name], default)) for lever, name in LEVER_OFF if name in v and default]
    bf16_d = paired(bf16, default) if bf16 and default else None
    comparisons = [*against.values(), *(d for _, d in levers), *([bf16_d] if bf16_d else [])]
    communicating = sorted((r for r in records if r.variant != COMPUTE_ONLY), key=lambda r: -r.median_step_s)
    rows = [[r.variant, r.n_buckets if r.n_buckets is not None else "–",
             fmt.size_mb((r.bucket_cap_bytes or 0) / MB) if r.is_bucketed and r.bucket_cap_bytes else "–",
             fmt.ms(r.median_step_s),
             f"{fmt.ms(r.exposed_overhead_s)} ({fmt.ms_interval(r.exposed_overhead_ci95_s)})"
             if r.variant != COMPUTE_ONLY else "0",
             f"{signed_ms(d.median_s)} ({fmt.ms_interval(d.interval_s)})" if (d := against.get(r.variant)) else "–"]
            for r in records]
    dtype = communication_dtype(BF16)
    path = exposed_overhead_figure(records, f"exposed overhead per variant on {machine.tag}",
                                   ctx.figure_path(f"{machine.tag}_{results.name}_exposed_overhead.png"))
    env, threads = results.environment, results.notes.get("threads_per_rank")
    return dict(
        tag=machine.tag, heading=fmt.run_heading(machine, results), env=env, threads=threads,
        setting=fmt.workload_setting_line(results, f"{results.setting.get('rounds', '?')} interleaved rounds"),
        s_bytes=4 * results.notes["n_parameters"] if results.notes.get("n_parameters") else None,
        floor=floor, torch=torch_ddp, against=list(against.values()), levers=levers, bf16=bf16_d,
        bf16_error=bf16.comm_error_rel if bf16 else None,
        bits=round(-math.log2(torch.finfo(dtype).eps)) + 1 if dtype else None,
        rounding=torch.finfo(dtype).eps / 2 if dtype else None,
        n_comparisons=len(comparisons), n_resolved=sum(d.resolved for d in comparisons),
        default_rank=next((i + 1 for i, r in enumerate(communicating) if r.variant == DEFAULT), None),
        n_communicating=len(communicating), first=_first_buckets(default, v.get(NO_FIRST)),
        table=fmt.table(["variant", "buckets", "bucket cap (MB)", "median step (ms)",
                         "exposed overhead (ms; 95% interval)", "step − torch DDP's per round (ms; 95% interval)"],
                        rows), figure=path, image=ctx.image(path, f"exposed overhead per variant on {machine.tag}"))


def ablation_page(ctx: RenderContext) -> Page:
    found = ablation_runs(ctx.inputs)
    runs = [_run(ctx, m, f) for m, f in found if f.records]
    missing = [s.name for s in coverage.note_gaps(ctx, STEP_KIND, "the lever ablation (`scripts/bench_ddp.py "
                                                  "--ablation`)", runs=[f for _, f in found])]
    markdown = templating.render("details/ablation.md.j2", runs=runs, missing=missing, default=DEFAULT,
                                 gaps="machines.md#not-measured-here")
    return Page("ablation", markdown, figures=[r["figure"] for r in runs])
