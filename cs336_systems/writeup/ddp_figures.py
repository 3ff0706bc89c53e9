"""The DDP step benchmark's figures: step times, the bucket sweep, the overhead model against measurements.

Spreads are drawn as paired 95% intervals (per-round differences, see bench/stats.py), never
as min–max whiskers, and time axes that show differences include 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from cs336_systems.bench.stats import paired_median
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.writeup.ddp_analysis import OverheadPrediction
from cs336_systems.writeup.figures import TWO_PANELS, WIDE, error_bars, save


def _exposed_ms(records: Sequence[StepRecord]) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """Exposed overheads (ms) and their paired 95% intervals as error bar lengths (None if any lacks one)."""
    exposed = np.array([r.exposed_overhead_s for r in records]) * 1e3
    intervals = [r.exposed_overhead_ci95_s for r in records]
    if not all(intervals):
        return exposed, None
    return exposed, error_bars(exposed, np.array([lo for lo, _ in intervals]) * 1e3,  # type: ignore[misc]
                               np.array([hi for _, hi in intervals]) * 1e3)  # type: ignore[misc]


def _median_outside_sync_ms(r: StepRecord) -> float:
    """Median over steps of (step - its synchronisation after backward), ms; the whole step without one."""
    if not r.sync_times_s or len(r.sync_times_s) != len(r.step_times_s):
        return r.median_step_s * 1e3
    return float(np.median(np.array(r.step_times_s) - np.array(r.sync_times_s))) * 1e3


def step_time_figure(records: Sequence[StepRecord], title: str, path: Path) -> Path:
    """Left: each variant's step stacked as (median time outside sync) then (median sync after
    backward); right: its exposed overhead with the paired 95% interval against compute-only."""
    names = [r.variant for r in records]
    rest = np.array([_median_outside_sync_ms(r) for r in records])
    sync = np.array([(r.median_sync_s or 0.0) * 1e3 if r.sync_times_s else 0.0 for r in records])
    height = 0.45 * len(records) + 2.1
    fig = Figure(figsize=(11.0, height))
    fig.subplots_adjust(left=0.14, right=0.98, bottom=1.05 / height, top=1 - 0.65 / height, wspace=0.08)
    ax_step, ax_exposed = fig.subplots(1, 2, sharey=True)
    y = np.arange(len(records))[::-1]
    ax_step.barh(y, rest, color="tab:blue", alpha=0.6, label="median time outside the sync phase (the whole step where there is none)")
    ax_step.barh(y, sync, left=rest, color="tab:orange", alpha=0.9,
                 label="then the median sync after backward")
    ax_step.set_yticks(y, names)
    ax_step.set(xlabel="time per training step (ms, medians over steps)", title="step, stacked")
    exposed, bars = _exposed_ms(records)
    ax_exposed.barh(y, exposed, xerr=bars, capsize=3, color="tab:green", alpha=0.6,
                    label="exposed overhead (step − compute-only step, per round; bars: 95% interval)")
    ax_exposed.axvline(0, color="black", lw=0.8)
    ax_exposed.set(xlabel="exposed overhead per step (ms)", title="exposed overhead, paired by round")
    for ax in (ax_step, ax_exposed):
        ax.grid(True, axis="x", alpha=0.3)
    handles = ax_step.get_legend_handles_labels()
    more = ax_exposed.get_legend_handles_labels()
    fig.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8, loc="lower center", ncols=2)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def bucket_sweep_figure(sweep: Sequence[StepRecord], references: dict[str, StepRecord], title: str, path: Path) -> Path:
    """Left: exposed overhead against bucket size with paired 95% intervals, other variants as lines
    with their intervals shaded; right: each size's step minus the first reference's (torch DDP
    when timed), per round, with its interval. Both axes include 0."""
    x = np.array([r.bucket_size_mb for r in sweep])
    fig = Figure(figsize=(WIDE[0], WIDE[1] + 0.4))
    fig.subplots_adjust(**{**TWO_PANELS, "left": 0.09, "bottom": 0.14})
    ax_exposed, ax_diff = fig.subplots(1, 2)
    exposed, bars = _exposed_ms(sweep)
    ax_exposed.errorbar(x, exposed, yerr=bars, fmt="o-", capsize=3, color="black", label="bucketed (ours)")
    for i, (name, r) in enumerate(references.items()):
        if name == "compute-only":
            continue
        color = f"C{i}"
        ax_exposed.axhline(r.exposed_overhead_s * 1e3, ls="--", color=color, label=name)
        if r.exposed_overhead_ci95_s:
            ax_exposed.axhspan(*(np.array(r.exposed_overhead_ci95_s) * 1e3), color=color, alpha=0.1)
    ax_exposed.axhline(0, color="black", lw=0.8)
    ax_exposed.set(xscale="log", xlabel="bucket size (MB)", ylabel="step − compute-only step (ms)")
    ax_exposed.set_title("exposed overhead, per round (bars, bands: 95% interval)", fontsize=10)
    reference = next((references[n] for n in ("torch-ddp", "per-parameter", "flat") if n in references), None)
    if reference is not None:
        differences = [paired_median(r.step_times_s, reference.step_times_s) for r in sweep]
        median = np.array([d for d, _ in differences]) * 1e3
        diff_bars = None
        if all(interval for _, interval in differences):
            diff_bars = error_bars(median, np.array([lo for _, (lo, _) in differences]) * 1e3,  # type: ignore[misc]
                                   np.array([hi for _, (_, hi) in differences]) * 1e3)  # type: ignore[misc]
        ax_diff.errorbar(x, median, yerr=diff_bars, fmt="o-", capsize=3, color="black",
                         label=f"bucketed − {reference.variant}")
        ax_diff.set_title(f"step − {reference.variant}'s, per round (bars: 95% interval)", fontsize=10)
    ax_diff.axhline(0, color="black", lw=0.8)
    ax_diff.set(xscale="log", xlabel="bucket size (MB)", ylabel="difference per step (ms)")
    for ax in (ax_exposed, ax_diff):
        ax.set_xticks(x, [f"{size:g}" for size in x])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def overhead_model_figure(
    prediction: OverheadPrediction, torch_ddp: StepRecord | None, title: str, path: Path
) -> Path:
    """The sweep against the bucket cap: measured exposed overhead (paired 95% intervals), measured
    wait after backward, the recursion's predicted wait, and the closed form at the buckets built.

    torch's DDP (25 MB buckets) is drawn at 25 MB with its own legend entry; the y axis starts at 0
    (below it only to show a negative median, which noise can give).
    """
    p = prediction
    fig = Figure(figsize=(7.5, 5.0))
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.27, top=0.93)
    ax = fig.subplots()
    records = [row.record for row in p.rows]
    x = np.array([r.bucket_size_mb for r in records], dtype=float)
    exposed = np.array([r.exposed_overhead_s for r in records]) * 1e3
    intervals = [r.exposed_overhead_ci95_s for r in records]
    bars = (error_bars(exposed, np.array([lo for lo, _ in intervals]) * 1e3, np.array([hi for _, hi in intervals]) * 1e3)
            if all(intervals) else None)
    ax.errorbar(x, exposed, yerr=bars, fmt="o", capsize=3, color="black",
                label="measured exposed overhead (step − compute-only; bars: 95% interval)")
    waits = [(xi, r.median_sync_s * 1e3) for xi, r in zip(x, records) if r.median_sync_s is not None]
    if waits:
        ax.plot(*zip(*waits), "s", color="tab:gray", label="measured wait after backward")
    predicted = [(xi, row.wait_s * 1e3) for xi, row in zip(x, p.rows) if row.wait_s is not None]
    if predicted:
        ax.plot(*zip(*predicted), "^-", color="tab:red", label="predicted wait (recursion, buckets as built)")
    ax.plot(x, [row.closed_form_s * 1e3 for row in p.rows], "v", color="tab:red", fillstyle="none",
            label="closed form o n_b + s/(w n_b) at the buckets built")
    channel = np.array([row.channel_s for row in p.rows]) * 1e3
    ranges = [row.channel_range_s for row in p.rows]
    channel_bars = (error_bars(channel, np.array([lo for lo, _ in ranges]) * 1e3, np.array([hi for _, hi in ranges]) * 1e3)
                    if all(ranges) else None)
    # Drawn a little to the right of each bucket cap, so its bars stand beside the measured ones.
    ax.errorbar(x * 1.12, channel, yerr=channel_bars, fmt="x--", capsize=3, color="tab:green",
                label="channel busy time n_b o + s/w, nothing hidden (bars: o's and w's 95% intervals)")
    if torch_ddp is not None:
        ax.plot([25.0], [torch_ddp.exposed_overhead_s * 1e3], "D", color="tab:purple",
                label="torch DDP, measured exposed overhead (25 MB buckets)")
    ax.set(xscale="log", xlabel="bucket cap (MB)", ylabel="time per step (ms)", title=title)
    ax.set_ylim(bottom=min(0.0, float(exposed.min()) * 1.1))  # from 0, lower only for a negative median
    ax.margins(x=0.08)
    ax.grid(True, alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="lower center", ncols=2)  # below: bars stay visible
    return save(fig, path)
