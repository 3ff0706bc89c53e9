"""Beyond the handout: the bucketed-DDP lever ablation (``ddp_step-ablation.json``), timed beside torch's DDP.

The ablation is a run of the DDP step benchmark (``scripts/bench_ddp.py --ablation``) with
:data:`~cs336_systems.bench.step.variants.ABLATION_VARIANTS`. Numbers only; the words are in
``templates/details/ablation.md.j2``. Every comparison is a paired difference (:mod:`.paired`), and the
page counts them, so that one resolved difference among many is read as what it may be: chance.
"""

from __future__ import annotations

import math

import torch

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import COMPUTE_ONLY, TORCH_DDP, communication_dtype
from cs336_systems.units import MB
from cs336_systems.writeup import coverage, fmt, templating
from cs336_systems.writeup.context import Page, RenderContext
from cs336_systems.writeup.ddp_analysis import STEP_KIND, ablation_runs, by_variant
from cs336_systems.bench.stats import one_side_chance
from cs336_systems.writeup.paired import by_chance, paired, signed_ms

DEFAULT, BF16, NO_FIRST = "bucketed-25MB", "bucketed-25MB-bf16", "bucketed-25MB-no-first"
# (lever, the variant with that lever alone switched off), compared with the default.
LEVER_OFF = (("gradient views", "bucketed-25MB-copy"), ("first-bucket cap", NO_FIRST),
             ("rebuild in ready order", "bucketed-25MB-no-reorder"), ("all three levers", "bucketed-25MB-plain"))


def _run(machine, results) -> dict:
    records: list[StepRecord] = results.records
    v, unfit = by_variant(records), fmt.not_evidence(results.environment)
    floor, torch_ddp, default, bf16 = v.get(COMPUTE_ONLY), v.get(TORCH_DDP), v.get(DEFAULT), v.get(BF16)
    against = {r.variant: paired(r, torch_ddp, unfit) for r in records
               if torch_ddp is not None and r.variant not in (COMPUTE_ONLY, TORCH_DDP)}
    levers = [(lever, paired(v[name], default, unfit)) for lever, name in LEVER_OFF if name in v and default]
    bf16_d = paired(bf16, default, unfit) if bf16 and default else None
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
    env, threads = results.environment, results.notes.get("threads_per_rank")
    return dict(
        heading=fmt.run_heading(machine, results), env=env, threads=threads, unfit=unfit,
        setting=fmt.workload_setting_line(results, f"{results.setting.get('rounds', '?')} interleaved rounds"),
        floor=floor, torch=torch_ddp, against=list(against.values()), levers=levers, bf16=bf16_d,
        bf16_error=bf16.comm_error_rel if bf16 else None,
        bits=round(-math.log2(torch.finfo(dtype).eps)) + 1 if dtype else None,
        rounding=torch.finfo(dtype).eps / 2 if dtype else None,
        n_comparisons=len(comparisons), n_resolved=sum(d.resolved for d in comparisons),
        by_chance=by_chance(comparisons), rounds=len(records[0].step_times_s),
        per_comparison=2 * (one_side_chance(len(records[0].step_times_s)) or 0.0),
        default_rank=next((i + 1 for i, r in enumerate(communicating) if r.variant == DEFAULT), None),
        n_communicating=len(communicating), first=(default, v[NO_FIRST]) if default and NO_FIRST in v and all(
            r.bucket_params and r.bucket_bytes for r in (default, v[NO_FIRST])) else None,
        table=fmt.table(["variant", "buckets", "bucket cap (MB)", "median step (ms)",
                         "exposed overhead (ms; 95% interval)", "step − torch DDP's per round (ms; 95% interval)"],
                        rows))


def ablation_page(ctx: RenderContext) -> Page:
    found = ablation_runs(ctx.inputs)
    runs = [_run(m, f) for m, f in found if f.records]
    missing = [s.name for s in coverage.note_gaps(ctx, STEP_KIND, "the lever ablation (`scripts/bench_ddp.py "
                                                  "--ablation`)", runs=[f for _, f in found])]
    markdown = templating.render("details/ablation.md.j2", runs=runs, missing=missing, default=DEFAULT,
                                 gaps="machines.md#not-measured-here")
    return Page("ablation", markdown)
