"""Problem distributed_communication_single_node: the all-reduce benchmark's numbers, table and plot.

Python computes; the words are in ``templates/answers/distributed_communication_single_node.md.j2``
and ``templates/details/allreduce.md.j2``. The reading rests on medians and on the line
``time = o + bytes / w`` fitted to each group (allreduce_analysis.py): ``o / median`` is the share
of a payload's time that the per-call cost explains.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from cs336_systems.bench.allreduce.record import AllReduceRecord, bus_bandwidth_factor
from cs336_systems.bench.allreduce.setting import DEFAULT_MEMORY_FRACTION
from cs336_systems.results.environment import Environment
from cs336_systems.writeup import fmt, templating
from cs336_systems.writeup.allreduce_analysis import (
    CommGroup, LinkFit, comm_groups, fit_group, ranks_per_core, time_sharing_bound,
)
from cs336_systems.writeup.context import Page, RenderContext, details_link
from cs336_systems.writeup.coverage import note_gaps
from cs336_systems.writeup.figures import TWO_PANELS, WIDE, error_bars, log_scale, save
from cs336_systems.writeup.allreduce_analysis import fit_with_intervals

BENCHMARK = AllReduceRecord.KIND
PROBLEM = "distributed_communication_single_node"


def allreduce_figure(groups: dict[CommGroup, list[AllReduceRecord]], title: str, path: Path) -> Path:
    """Median time (bars: p10–p90) and busbw against payload, one line per backend and world size;
    dashed lines are gloo ranks sharing a GPU."""
    fig = Figure(figsize=WIDE)
    fig.subplots_adjust(**TWO_PANELS)
    ax_time, ax_bw = fig.subplots(1, 2)
    for group, records in groups.items():
        x = np.array([r.payload_mb for r in records])
        median = np.array([r.median_s for r in records]) * 1e3
        spread = error_bars(median, np.array([r.p10_s for r in records]) * 1e3,
                            np.array([r.p90_s for r in records]) * 1e3)
        style = "--" if group.shared_gpu else "-"
        line = ax_time.errorbar(x, median, yerr=spread, fmt="o" + style, capsize=3, label=group.label)
        bw = np.array([r.busbw_gbps for r in records])
        bw_spread = error_bars(bw, *np.array([r.busbw_range_gbps() for r in records]).T)
        ax_bw.errorbar(x, bw, yerr=bw_spread, fmt="o" + style, capsize=3, color=line[0].get_color(),
                       label=group.label)
    for ax, which in ((ax_time, "x"), (ax_time, "y"), (ax_bw, "x")):
        log_scale(ax, which)
    ax_time.set(xlabel="payload (MB)", ylabel="median time per all-reduce (ms)",
                title="time (bars: p10–p90)")
    ax_bw.set(xlabel="payload (MB)", ylabel="busbw (GB/s)",
              title="bus bandwidth (bars: at the p90 and p10 times)")
    ax_bw.set_ylim(bottom=0)
    for ax in (ax_time, ax_bw):
        ax.grid(True, alpha=0.3)
    ax_bw.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


@dataclass(frozen=True)
class Line:
    """One group (backend, device, ranks) with its records and its fitted per-call cost."""

    group: CommGroup
    records: list[AllReduceRecord]
    o_s: float | None  # None: no fit, or a fit with a negative intercept

    def o_share(self, r: AllReduceRecord) -> float | None:
        return None if self.o_s is None or not r.median_s else self.o_s / r.median_s


def _o(records: list[AllReduceRecord]) -> float | None:
    fit = fit_group(records)
    return fit.o_s if isinstance(fit, LinkFit) and fit.o_s > 0 else None


def _table(lines: dict[CommGroup, Line], records: list[AllReduceRecord]) -> str:
    rows = []
    for r in sorted(records, key=lambda r: (r.backend, r.device_type, r.world_size, r.payload_bytes)):
        head = [r.backend, r.device_type + (" (shared GPU)" if r.shared_gpu else ""), r.world_size,
                fmt.size_mb(r.payload_mb)]
        if not r.measured:
            rows.append(head + ["0", "–", "–", "–", "–", "–", f"skipped: {r.skip_reason or 'no times'}"])
            continue
        line = lines[CommGroup(r.backend, r.device_type, r.world_size, r.shared_gpu)]
        check = "unchecked" if r.correct is None else "correct" if r.correct else "**WRONG**"
        rows.append(head + [r.timed_iters, fmt.ms(r.median_s), f"{fmt.ms(r.p10_s)}–{fmt.ms(r.p90_s)}",
                            fmt.sig(r.algbw_gbps), fmt.sig(r.busbw_gbps), fmt.pct(line.o_share(r), 2), check])
    return fmt.table(["backend", "device", "ranks", "payload (MB)", "timed iters", "median (ms)", "p10–p90 (ms)",
                      "algbw (GB/s)", "busbw (GB/s)", "o / median", "result"], rows, align="llrrrrrrrrl")


def _pivot(lines: list[Line]) -> str:
    """Median time and busbw, one row per line and one column per payload."""
    payloads = sorted({r.payload_bytes for line in lines for r in line.records})
    rows = []
    for line in lines:
        by_payload = {r.payload_bytes: r for r in line.records}
        rows.append([line.group.label] + [f"{fmt.ms(by_payload[p].median_s)} ms · {fmt.sig(by_payload[p].busbw_gbps)}"
                                          if p in by_payload else "–" for p in payloads])
    return fmt.table(["ranks", *(f"{fmt.size_mb(p / 2**20)} MB" for p in payloads)], rows)


def _kind(lines: list[Line], env: Environment) -> dict:
    """What the commentary of one backend and device reads: peak, per-call cost, growth with ranks."""
    peak = max((r for line in lines for r in line.records), key=lambda r: r.busbw_gbps or 0.0)
    first, last = lines[0], lines[-1]
    common = {r.payload_bytes for r in first.records} & {r.payload_bytes for r in last.records}
    ranks = None
    if len(lines) > 1 and common:
        a = next(r for r in first.records if r.payload_bytes == max(common))
        b = next(r for r in last.records if r.payload_bytes == max(common))
        n0, n1, cores = first.group.world_size, last.group.world_size, env.cpu_count
        bound = (time_sharing_bound(n0, n1, cores)
                 if first.group.device_type == "cpu" and cores and n1 > cores else None)
        ratio = (b.median_s or 0.0) / (a.median_s or 1.0)
        ring = bus_bandwidth_factor(n1) / bus_bandwidth_factor(n0)
        ranks = dict(a=a, b=b, ratio=ratio, ring=ring, bound=bound,
                     reading="below" if ratio < ring else "between" if bound is None or ratio <= bound else "above")
    crowded = [(line.group.world_size, ranks_per_core(line.group.world_size, env.cpu_count)) for line in lines]
    # How well the first line's fit pins o down, against its smallest payload's fastest calls.
    first_fit = fit_with_intervals(first.group, first.records)
    return dict(group=first.group, lines=lines, peak=peak, ranks=ranks, cores=env.cpu_count, gpus=env.gpu_count,
                crowded=[(n, share) for n, share in crowded if share is not None],
                o_interval=first_fit.intervals.o_s if first_fit.intervals else None)


def allreduce_page(ctx: RenderContext) -> Page:
    runs, figures = [], []
    for machine, results in ctx.inputs.runs(BENCHMARK):
        records, env = results.records, results.environment
        lines = {g: Line(g, rs, _o(rs)) for g, rs in comm_groups(records).items()}
        kinds: dict[tuple, list[Line]] = {}
        for line in lines.values():
            kinds.setdefault((line.group.backend, line.group.device_type, line.group.shared_gpu), []).append(line)
        figure = None
        if lines:
            figure = allreduce_figure(comm_groups(records), f"all-reduce on {fmt.hardware(env)}",
                                      ctx.figure_path(f"{machine.tag}_{results.name}_allreduce.png"))
            figures.append(figure)
        asked = sorted({(r.requested_timed_iters, r.requested_warmup_iters) for r in records})
        parts = [f"backend {', '.join(sorted({r.backend for r in records}))}",
                 f"world sizes {', '.join(str(n) for n in sorted({r.world_size for r in records}))}",
                 *(f"{t} timed iterations per payload after {w} warm-up" for t, w in asked)]
        threads = sorted({r.threads_per_rank for r in records if r.threads_per_rank})
        parts += [f"{t} torch thread{'s' if t > 1 else ''} per rank" for t in threads]
        measured = [r for r in records if r.measured]
        runs.append(dict(
            tag=machine.tag, setting=fmt.setting_line(env, results.source, parts=parts), table=_table(lines, records),
            pivot=_pivot(list(lines.values())), kinds=[_kind(ls, env) for ls in kinds.values()],
            figure=figure and ctx.image(figure, f"all-reduce time and busbw against payload on {machine.tag}"),
            measured=len(measured), wrong=[r for r in measured if r.correct is False],
            skipped=[r for r in records if not r.measured],
            memory_skips=any((r.skip_reason or "").startswith("memory") for r in records if not r.measured),
            memory_fraction=results.setting.get("memory_fraction", 0.5), wall_s=results.notes.get("wall_s", 0),
            answer_figure=figure and ctx.answer_image(figure, f"all-reduce time and busbw against payload on {machine.tag}")))
    missing = [s.name for s in note_gaps(ctx, BENCHMARK, "the all-reduce benchmark")]
    values = dict(runs=runs, missing=missing, details=details_link("allreduce"), guard=DEFAULT_MEMORY_FRACTION)
    return Page("allreduce", templating.render("details/allreduce.md.j2", **values),
                {PROBLEM: templating.render(f"answers/{PROBLEM}.md.j2", **values)}, figures)
