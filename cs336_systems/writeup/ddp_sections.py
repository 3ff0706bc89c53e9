"""The DDP step benchmark's page and its answers (naive_ddp_benchmarking to ddp_bucketed_benchmarking (a)).

Every step run but the lever ablation gets one table of every variant, one of paired differences,
its figures and bucket plans; the answers quote a few of those numbers and link to the run.
"""

from __future__ import annotations

import statistics
from typing import Any

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import COMPUTE_ONLY, TORCH_DDP
from cs336_systems.ddp.overhead_model import FitIntervals
from cs336_systems.writeup import coverage, fmt, templating
from cs336_systems.writeup.allreduce_analysis import LinkFit
from cs336_systems.writeup.bucket_plan import buckets, large_cap, parameter_shapes
from cs336_systems.writeup.bucketed_section import comparisons, sweep_verdict
from cs336_systems.writeup.context import Page, RenderContext, details_link
from cs336_systems.writeup.ddp_analysis import STEP_KIND, bucket_sweep, by_variant, gradient_bytes, run_fit, step_runs
from cs336_systems.writeup.ddp_figures import bucket_sweep_figure, step_time_figure
from cs336_systems.writeup.load import MachineResults, ResultsFile
from cs336_systems.writeup.overhead_fit import fit_for_run
from cs336_systems.writeup.paired import Paired, paired, paired_sync, paired_table
from cs336_systems.writeup.step_setting import ddp_setting_line, run_facts
from cs336_systems.writeup.step_tables import variant_table

ANSWERED = ("naive_ddp_benchmarking", "minimal_ddp_flat_benchmarking", "ddp_overlap_individual_parameters_benchmarking",
            "ddp_bucketed_benchmarking")


def _named(v: dict[str, StepRecord], unfit: str | None) -> dict[str, Paired | None]:
    """The comparisons the answers quote, None where a variant is missing."""
    def pair(a: str, b: str, sync: bool = False) -> Paired | None:
        return None if a not in v or b not in v else (paired_sync if sync else paired)(v[a], v[b], unfit)
    return dict(flat=pair("flat", "naive"), flat_sync=pair("flat", "naive", True),
                overlap=pair("per-parameter", "naive"), overlap_flat=pair("per-parameter", "flat"),
                overlap_sync=pair("per-parameter", "naive", True))


def _differences(v: dict[str, StepRecord], named: dict[str, Paired | None],
                 sweep: list[StepRecord], rehearsal: bool, unfit: str | None) -> list[Paired]:
    """Every comparison of the run, once: the named ones, torch DDP against naive, and the sweep's; none
    at world size 1 and none against compute-only (the table's exposed overhead is that difference)."""
    if rehearsal:
        return []
    torch_ddp = [paired(v[TORCH_DDP], v["naive"], unfit)] if TORCH_DDP in v and "naive" in v else []
    found = [d for d in named.values() if d is not None] + torch_ddp + comparisons(sweep, v, unfit)
    return list({(d.a, d.b, d.what): d for d in found}.values())  # each pair once, in first-found order


def _predictions(fit: LinkFit | str | None, s_bytes: float | None, naive: StepRecord | None,
                 intervals: FitIntervals | None = None) -> dict[str, Any]:
    """What the all-reduce line o + bytes/w of this machine predicts for naive's calls and flat's one call;
    for naive's also the span over o's and w's 95% intervals (None without them)."""
    if not isinstance(fit, LinkFit) or not s_bytes:
        return dict(fit=fit if isinstance(fit, str) else None, naive=None, naive_range=None, flat=None)
    calls = naive.allreduce_calls_per_step or 0 if naive else 0
    naive_range = None
    if calls and intervals is not None:
        (o_low, o_high), (w_low, w_high) = intervals.o_s, intervals.w_bytes_per_s
        naive_range = (calls * max(o_low, 0.0) + s_bytes / w_high, calls * max(o_high, 0.0) + s_bytes / w_low)
    return dict(fit=fit, naive=calls * fit.o_s + s_bytes / fit.w_bytes_per_s if calls else None,
                naive_range=naive_range, flat=fit.o_s + s_bytes / fit.w_bytes_per_s)


def ddp_run(ctx: RenderContext, machine: MachineResults, results: ResultsFile) -> dict[str, Any]:
    """One run's values: setting, its one table, paired differences, flat's copies, sweep, plans, figures."""
    records: list[StepRecord] = results.records
    v, sweep = by_variant(records), bucket_sweep(records)
    floor, flat = v.get(COMPUTE_ONLY), v.get("flat")
    rehearsal = results.environment.world_size == 1
    unfit = fmt.not_evidence(results.environment)
    named = _named(v, unfit)
    differences = _differences(v, named, sweep, rehearsal, unfit)
    stem = f"{machine.tag}_{results.name}"
    figures = [step_time_figure(records, f"step time per variant, {stem}", ctx.figure_path(f"{stem}_step_time.png"))]
    references = {n: v[n] for n in ("torch-ddp", "per-parameter", "flat") if n in v}
    if sweep:
        figures.append(bucket_sweep_figure(sweep, references, f"bucket sweep, {stem}",
                                           ctx.figure_path(f"{stem}_bucket_sweep.png")))
    s_bytes, line = gradient_bytes(results), fit_for_run(machine, results)
    copies = None
    if flat is not None and flat.pack_times_s and flat.unpack_times_s:
        copies = dict(pack=statistics.median(flat.pack_times_s), unpack=statistics.median(flat.unpack_times_s))
    return dict(
        tag=machine.tag, name=results.name, source=results.source, anchor=stem.replace("_", "-"),
        link=details_link("ddp_step", stem.replace("_", "-")), rehearsal=rehearsal, env=results.environment,
        setting=ddp_setting_line(results), facts=run_facts(results, floor.median_step_s if floor else None),
        v=v, d=named, table=variant_table(records), differences=paired_table(differences) if differences else None,
        copies=copies, predicted=_predictions(run_fit(machine, results), s_bytes, v.get("naive"), line and line.intervals),
        s_bytes=s_bytes,
        sweep=sweep, verdict=sweep_verdict(sweep, v, comparisons(sweep, v, unfit), unfit) if sweep else None,
        plans=[dict(record=r, buckets=buckets(r)) for r in sweep],
        large_cap=large_cap(sweep, s_bytes, parameter_shapes(results.setting)),
        images=[ctx.image(p, p.stem.replace("_", " ")) for p in figures], figures=figures)


def ddp_step_page(ctx: RenderContext) -> Page:
    runs = [ddp_run(ctx, m, f) for m, f in step_runs(ctx.inputs)]
    measured = [r for r in runs if not r["rehearsal"]]
    missing = [s.name for s in coverage.note_gaps(ctx, STEP_KIND, "the DDP step benchmark (two or more ranks)",
                                                  runs=[f for _, f in step_runs(ctx.inputs)
                                                        if f.environment.world_size > 1])]
    values = dict(runs=runs, measured=measured, rehearsals=[r for r in runs if r["rehearsal"]], missing=missing,
                  gaps=details_link("machines", "not-measured-here"))
    answers = {p: templating.render(f"answers/{p}.md.j2", **values) for p in ANSWERED}
    markdown = templating.render("details/ddp_step.md.j2", **{**values, "gaps": "machines.md#not-measured-here"})
    return Page("ddp_step", markdown, answers, [p for r in runs for p in r["figures"]])
