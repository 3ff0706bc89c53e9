"""The DDP step benchmark's figures: every variant's step, and the bucket sweep.

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
from cs336_systems.writeup.figures import TWO_PANELS, WIDE, error_bars, log_scale, save


def _with_bars(values_s: Sequence[float], intervals_s: Sequence[tuple[float, float] | None]):
    """Values in ms and their intervals as error bar lengths (None unless every value has one)."""
    values = np.array(values_s) * 1e3
    known = [i for i in intervals_s if i is not None]
    if len(known) != len(values):
        return values, None
    return values, error_bars(values, np.array([lo for lo, _ in known]) * 1e3, np.array([hi for _, hi in known]) * 1e3)


def _exposed(records: Sequence[StepRecord]):
    return _with_bars([r.exposed_overhead_s for r in records], [r.exposed_overhead_ci95_s for r in records])


def step_time_figure(records: Sequence[StepRecord], title: str, path: Path) -> Path:
    """Left: each variant's median step, its median sync after backward drawn at its end; right: its
    exposed overhead with the paired 95% interval against compute-only."""
    height = 0.4 * len(records) + 2.1
    fig = Figure(figsize=(11.0, height))
    fig.subplots_adjust(left=0.14, right=0.98, bottom=1.05 / height, top=1 - 0.65 / height, wspace=0.08)
    ax_step, ax_exposed = fig.subplots(1, 2, sharey=True)
    y = np.arange(len(records))[::-1]
    step = np.array([r.median_step_s for r in records]) * 1e3
    sync = np.array([r.median_sync_s or 0.0 for r in records]) * 1e3
    ax_step.barh(y, step - sync, color="tab:blue", alpha=0.6, label="median step less the median sync")
    ax_step.barh(y, sync, left=step - sync, color="tab:orange", label="median sync after backward")
    ax_step.set_yticks(y, [r.variant for r in records])
    ax_step.set(xlabel="time per training step (ms)", title="step")
    exposed, bars = _exposed(records)
    ax_exposed.barh(y, exposed, xerr=bars, capsize=3, color="tab:green", alpha=0.6,
                    label="exposed overhead (step − compute-only, per round; bars: 95% interval)")
    ax_exposed.axvline(0, color="black", lw=0.8)
    ax_exposed.set(xlabel="exposed overhead per step (ms)", title="exposed overhead, paired by round")
    ax_step.grid(True, axis="x", alpha=0.3)
    ax_exposed.grid(True, axis="x", alpha=0.3)
    fig.legend(*[a + b for a, b in zip(ax_step.get_legend_handles_labels(), ax_exposed.get_legend_handles_labels())],
               fontsize=8, loc="lower center", ncols=3)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def bucket_sweep_figure(sweep: Sequence[StepRecord], references: dict[str, StepRecord], title: str, path: Path) -> Path:
    """Left: exposed overhead against bucket size (paired 95% intervals), the other variants as lines
    with their intervals shaded; right: each size's step minus the first reference's, per round."""
    x = np.array([r.bucket_size_mb for r in sweep], dtype=float)
    fig = Figure(figsize=(WIDE[0], WIDE[1] + 0.4))
    fig.subplots_adjust(**{**TWO_PANELS, "left": 0.09, "bottom": 0.14})
    ax_exposed, ax_diff = fig.subplots(1, 2)
    for ax in (ax_exposed, ax_diff):
        log_scale(ax, "x")
    exposed, bars = _exposed(sweep)
    ax_exposed.errorbar(x, exposed, yerr=bars, fmt="o-", capsize=3, color="black", label="bucketed (ours)")
    for i, (name, r) in enumerate(references.items()):
        ax_exposed.axhline(r.exposed_overhead_s * 1e3, ls="--", color=f"C{i}", label=name)
        if r.exposed_overhead_ci95_s:
            low, high = r.exposed_overhead_ci95_s
            ax_exposed.axhspan(low * 1e3, high * 1e3, color=f"C{i}", alpha=0.1)
    ax_exposed.set(xlabel="bucket size (MB)", ylabel="step − compute-only step (ms)")
    ax_exposed.set_title("exposed overhead, per round (bars, bands: 95% interval)", fontsize=10)
    reference = next(iter(references.values()), None)
    if reference is not None:
        differences = [paired_median(r.step_times_s, reference.step_times_s) for r in sweep]
        median, diff_bars = _with_bars([d for d, _ in differences], [i for _, i in differences])
        ax_diff.errorbar(x, median, yerr=diff_bars, fmt="o-", capsize=3, color="black",
                         label=f"bucketed − {reference.variant}")
        ax_diff.set_title(f"step − {reference.variant}'s, per round (bars: 95% interval)", fontsize=10)
    ax_diff.set(xlabel="bucket size (MB)", ylabel="difference per step (ms)")
    for ax in (ax_exposed, ax_diff):
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(x, [f"{size:g}" for size in x])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)
