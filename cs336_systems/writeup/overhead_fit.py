"""Problem 6b's inputs from the all-reduce benchmark: ``o`` and ``w`` fitted per line, with
bootstrap intervals, R² on the residuals the fit minimises, and why ``w`` can lie above every
measured algbw.

The fit itself is :func:`cs336_systems.ddp.overhead_model.fit_latency_bandwidth` (through
``allreduce_analysis.fit_group``); the intervals resample each payload's timed iterations
(``AllReduceRecord.times_s``) with a fixed seed, so the same results file always renders the
same intervals.
"""

from __future__ import annotations

from dataclasses import dataclass

from cs336_systems.bench.allreduce.record import AllReduceRecord
from cs336_systems.ddp.overhead_model import FitIntervals, bootstrap_latency_bandwidth
from cs336_systems.results.environment import Environment
from cs336_systems.writeup import fmt
from cs336_systems.writeup.allreduce_analysis import CommGroup, LinkFit, comm_groups, fit_group, ranks_per_core
from cs336_systems.writeup.context import RenderContext
from cs336_systems.writeup.load import MachineResults

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class GroupFit:
    """One line of the all-reduce benchmark (a backend, device, world size) and its fit."""

    group: CommGroup
    records: list[AllReduceRecord]  # measured, by payload
    fit: LinkFit | str  # the fit, or why there is none
    intervals: FitIntervals | None  # None without a fit or without iteration times


def fit_with_intervals(group: CommGroup, records: list[AllReduceRecord]) -> GroupFit:
    fit = fit_group(records)
    intervals = None
    if isinstance(fit, LinkFit) and all(r.times_s for r in records):
        try:
            intervals = bootstrap_latency_bandwidth([r.payload_bytes for r in records], [r.times_s for r in records],
                                                    resamples=BOOTSTRAP_RESAMPLES, seed=BOOTSTRAP_SEED)
        except ValueError:
            intervals = None
    return GroupFit(group, records, fit, intervals)


def machine_fits(machine: MachineResults) -> list[GroupFit]:
    """Every line of the machine's all-reduce runs, the first run's where two runs share one."""
    fits: dict[CommGroup, GroupFit] = {}
    for results in machine.runs(AllReduceRecord.KIND):
        for group, records in comm_groups(results.records).items():
            if group not in fits:
                fits[group] = fit_with_intervals(group, records)
    return list(fits.values())


def _interval(values: tuple[float, float], show) -> str:
    return f"{show(values[0])} to {show(values[1])}"


def _fit_table(fits: list[GroupFit]) -> str:
    rows = []
    for g in fits:
        sizes = ", ".join(fmt.size_mb(r.payload_mb) for r in g.records)
        where = "gloo ranks sharing one GPU" if g.group.shared_gpu else g.group.device_type
        head = [g.group.backend, where, g.group.world_size, sizes]
        if isinstance(g.fit, str):
            rows.append(head + ["–"] * 5 + [f"no fit: {g.fit}"])
            continue
        iv = g.intervals
        best = max(g.records, key=lambda r: r.algbw_gbps)
        rows.append(head + [fmt.us(g.fit.o_s), _interval(iv.o_s, fmt.us) if iv else "–", fmt.gbps(g.fit.w_bytes_per_s),
                            _interval(iv.w_bytes_per_s, fmt.gbps) if iv else "–", fmt.sig(g.fit.r2, 4),
                            f"{fmt.sig(best.algbw_gbps)} at {fmt.size_mb(best.payload_mb)} MB"])
    return fmt.table(["backend", "device", "ranks", "payloads fitted (MB)", "o (µs)", "o: 95% interval (µs)",
                      "w (GB/s)", "w: 95% interval (GB/s)", "R² (relative residuals)",
                      "highest measured algbw (GB/s)"], rows, align="llrlrrrrrl")


def w_above_algbw(g: GroupFit, env: Environment) -> str | None:
    """Why the fitted ``w`` exceeds every measured algbw of the line, in numbers; None if it does not."""
    fit = g.fit
    if isinstance(fit, str):
        return None
    best = max(g.records, key=lambda r: r.algbw_gbps)
    w = fit.w_bytes_per_s
    if w <= best.algbw_gbps * 1e9:
        return None
    x = best.payload_bytes
    on_line = fit.o_s + x / w
    line_algbw = x / on_line
    from_o = (w - line_algbw) / (w - best.algbw_gbps * 1e9)
    interval = (f" (95% interval {fmt.gbps(g.intervals.w_bytes_per_s[0])} to {fmt.gbps(g.intervals.w_bytes_per_s[1])})"
                if g.intervals else "")
    text = (f"{g.group.label}: the fitted $w$ = {fmt.gbps(w)} GB/s{interval} lies above every measured algbw (at "
            f"most {fmt.sig(best.algbw_gbps)} GB/s, at {fmt.size_mb(best.payload_mb)} MB). A line with a fixed cost "
            "never reaches its own $w$: $x$ bytes take $o + x/w$, an algbw of $w/(1 + o\\,w/x)$, which at "
            f"{fmt.size_mb(best.payload_mb)} MB is {fmt.gbps(line_algbw)} GB/s. ")
    if from_o >= 0.995:
        text += "That accounts for all of the gap: the measured point lies on the line."
    else:
        text += (f"That accounts for {fmt.pct(max(from_o, 0.0))} of the gap; the rest is the point lying off the line "
                 f"({fmt.ms(best.median_s)} ms measured against the line's {fmt.ms(on_line)} ms).")
    if len(g.records) >= 2:
        largest, below = g.records[-1], g.records[-2]
        grown = largest.median_s - below.median_s
        if grown > 0 and (largest.payload_bytes - below.payload_bytes) / grown < 0.95 * w:
            marginal = (largest.payload_bytes - below.payload_bytes) / grown
            text += (f" Between the two largest payloads the time grows at only {fmt.gbps(marginal)} GB/s: each extra "
                     "byte costs more at large payloads than a line allows, and the relative fit, which gives the "
                     "small payloads (where the fixed cost dominates) as much say as the large ones, takes its slope "
                     "from the smaller payloads.")
    crowded = ranks_per_core(g.group.world_size, env.cpu_count)
    if crowded and g.group.device_type == "cpu":
        text += (f" The {g.group.world_size} ranks outnumber the {env.cpu_count} cores ({fmt.sig(crowded)} ranks per "
                 "core): they take turns on the cores, and a long transfer is interrupted more often than a short one.")
    return text


def fit_part(ctx: RenderContext) -> list[str]:
    out = ["### Fitting $o$ and $w$ to the all-reduce benchmark", "",
           "Least squares on median time $= o + \\text{bytes}/w$ over the measured payloads of each backend and "
           "world size, each residual taken relative to its measured time: the payloads span decades, and with "
           "plain residuals the largest payload's run-to-run noise would swamp a per-call cost of about a "
           "millisecond (`cs336_systems/ddp/overhead_model.py`). $R^2$ is computed on those relative residuals, "
           "the ones the fit minimises (weighted by $1/t^2$, against the weighted mean time). The intervals are "
           f"bootstrap percentiles: {BOOTSTRAP_RESAMPLES} resamples of each payload's timed iterations (the slowest "
           "rank's time of each), the median taken and the line refitted each time. $w$ is bytes of payload per "
           "second of one all-reduce (like algbw, not busbw)."]
    for machine in ctx.inputs.machines:
        runs = machine.runs(AllReduceRecord.KIND)
        if not runs:
            continue
        fits = machine_fits(machine)
        out += ["", f"#### Machine `{machine.tag}`", "",
                fmt.setting_line(runs[0].environment, "`, `".join(r.source for r in runs)),
                "", _fit_table(fits) if fits else "No measured payloads to fit."]
        notes = [n for n in (w_above_algbw(g, runs[0].environment) for g in fits) if n]
        if notes:
            out += ["", "Why $w$ can exceed every measured algbw:", "", *[f"- {n}" for n in notes]]
    return out
