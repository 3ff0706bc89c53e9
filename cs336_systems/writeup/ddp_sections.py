"""The DDP step benchmark's page and its answers (naive_ddp_benchmarking to ddp_bucketed_benchmarking (a)).

Every step run but the lever ablation gets one table of every variant, one of paired differences,
its figures and bucket plans; the answers quote a few of those numbers and link to the run. The
variant table's columns are defined in ``templates/details/ddp_step.md.j2``; at world size 1 (nothing
communicated) the same table shows each wrapper's own cost.

ddp_bucketed_benchmarking (a)'s verdict (does the sweep match the expected U shape between
per-parameter and flat?) follows from the intervals, never from the medians' order; the template
words it. One rule for multiple comparisons, applied to every comparison alike: each resolved
interval counts, and the page says how many wins in one direction the whole family of comparisons
would show by chance alone (``one_side_chance`` per comparison, summed: the sign test's actual
error, not a nominal 5%).
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

from cs336_systems.bench.stats import one_side_chance
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import COMPUTE_ONLY, TORCH_DDP
from cs336_systems.ddp.overhead_model import FitIntervals
from cs336_systems.writeup import coverage, fmt, templating
from cs336_systems.writeup.allreduce_analysis import LinkFit
from cs336_systems.writeup.step_setting import buckets, large_cap, parameter_shapes
from cs336_systems.writeup.context import Page, RenderContext, details_link
from cs336_systems.writeup.ddp_analysis import (STEP_KIND, bucket_sweep, by_variant, core_time_taken, gradient_bytes,
                                                run_fit, step_runs)
from cs336_systems.writeup.ddp_figures import bucket_sweep_figure, step_time_figure
from cs336_systems.writeup.load import MachineResults, ResultsFile
from cs336_systems.writeup.allreduce_analysis import fit_for_run
from cs336_systems.writeup.paired import Paired, paired, paired_sync, paired_table, by_chance
from cs336_systems.writeup.step_setting import ddp_setting_line, run_facts

ANSWERED = ("naive_ddp_benchmarking", "minimal_ddp_flat_benchmarking", "ddp_overlap_individual_parameters_benchmarking",
            "ddp_bucketed_benchmarking")


VARIANT_HEADERS = ["variant", "buckets", "all-reduce calls / step", "median step (ms)", "min–max (ms)",
                   "sync after backward (ms)", "sync share", "exposed overhead (ms)", "its 95% interval (ms)",
                   "tokens/s"]


REFERENCES = (TORCH_DDP, "per-parameter", "flat")


def comparisons(sweep: list[StepRecord], v: dict[str, StepRecord], unfit: str | None = None) -> list[Paired]:
    """Each size against the next larger one, then every size against torch DDP, per-parameter and flat."""
    out = [paired(b, a, unfit) for a, b in zip(sweep, sweep[1:])]
    return out + [paired(r, v[ref], unfit) for ref in REFERENCES if ref in v for r in sweep]


def _same_buckets(a: StepRecord, b: StepRecord) -> bool:
    return bool(a.bucket_bytes) and a.bucket_bytes == b.bucket_bytes


def sweep_verdict(sweep: list[StepRecord], v: dict[str, StepRecord], differences: list[Paired],
                  unfit: str | None = None) -> dict:
    """Which neighbouring sizes are told apart, which sizes beat flat and per-parameter (resolved), the
    word ("yes": a size below the largest, so short of flat-like, beats both; else "no", the
    sizes that beat one reference still listed; None when the run's times are not evidence, ``unfit`` saying why), the noise (how many comparisons stay unresolved), the wins expected by chance over all of
    them, and the sizes that built the same buckets as another yet disagree with it against a reference
    (the same plan measured twice: a fact the page states beside the chance, not a discount)."""
    adjacent = differences[:max(len(sweep) - 1, 0)]
    beats = {ref: [r for r in sweep if (d := paired(r, v[ref], unfit)).resolved and d.median_s < 0]
             for ref in ("flat", "per-parameter") if ref in v}
    twins = {ref: [(r, [x for x in sweep if x is not r and _same_buckets(x, r) and x not in found]) for r in found]
             for ref, found in beats.items()}
    twins = {ref: [(r, t) for r, t in pairs if t] for ref, pairs in twins.items()}
    middle = [r for r in sweep[:-1] if all(r in b for b in beats.values())] if len(beats) == 2 else []
    with_interval = [d for d in differences if d.interval_s is not None]
    noise = dict(unresolved=sum(not d.resolved for d in with_interval), n=len(with_interval),
                 width=statistics.median(d.interval_s[1] - d.interval_s[0] for d in with_interval if d.interval_s),
                 size=statistics.median(abs(d.median_s) for d in with_interval), rounds=with_interval[0].rounds,
                 per_comparison=one_side_chance(with_interval[0].rounds),
                 by_chance=by_chance(with_interval, sides=1)) if with_interval else None
    return dict(adjacent=len(adjacent), told_apart=[d for d in adjacent if d.resolved], beats=beats, noise=noise,
                twins={ref: pairs for ref, pairs in twins.items() if pairs},
                word=None if unfit else "yes" if middle else "no",
                middle=middle, unfit=unfit)


def variant_row(r: StepRecord) -> list:
    """Calls, step time and spread, sync phase and its share, exposed overhead, throughput."""
    calls = r.allreduce_calls_per_step
    if r.variant == TORCH_DDP:
        sync_cell = share_cell = "inside backward"
    elif r.variant == COMPUTE_ONLY:
        sync_cell = share_cell = "–"
    else:
        sync_cell, share_cell = fmt.ms(r.median_sync_s), fmt.pct(r.sync_share)
    return [r.variant, "–" if r.n_buckets is None else r.n_buckets,
            "0" if r.variant == COMPUTE_ONLY else ("–" if calls is None else f"{calls:g}"),
            fmt.ms(r.median_step_s), f"{fmt.ms(r.min_step_s)}–{fmt.ms(r.max_step_s)}", sync_cell, share_cell,
            fmt.ms(r.exposed_overhead_s),
            "–" if r.variant == COMPUTE_ONLY else fmt.ms_interval(r.exposed_overhead_ci95_s), fmt.sig(r.tokens_per_s)]


def variant_table(records: Iterable[StepRecord]) -> str:
    return fmt.table(VARIANT_HEADERS, [variant_row(r) for r in records])


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
        core=core_time_taken(records, results.setting.get("steps_per_round") or 1),
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
