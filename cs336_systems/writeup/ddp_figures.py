"""The DDP step benchmark's figures: step times, the bucket sweep, the overhead model against measurements."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from cs336_systems.units import MB
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.writeup.ddp_analysis import OverheadPrediction
from cs336_systems.writeup.figures import TWO_PANELS, WIDE, error_bars, save


def step_time_figure(records: Sequence[StepRecord], title: str, path: Path) -> Path:
    """Median step time per variant (bars, min–max whiskers), the synchronisation phase shaded."""
    names = [r.variant for r in records]
    median = np.array([r.median_step_s for r in records]) * 1e3
    spread = error_bars(median, np.array([r.min_step_s for r in records]) * 1e3,
                     np.array([r.max_step_s for r in records]) * 1e3)
    sync = np.array([r.median_sync_s or 0.0 for r in records]) * 1e3
    height = 0.45 * len(records) + 1.8
    fig = Figure(figsize=(8.0, height))
    fig.subplots_adjust(left=0.2, right=0.97, bottom=0.95 / height, top=1 - 0.35 / height)
    ax = fig.subplots()
    y = np.arange(len(records))[::-1]
    ax.barh(y, median, xerr=spread, capsize=3, color="tab:blue", alpha=0.6, label="median step (whiskers: min–max)")
    ax.barh(y, sync, color="tab:orange", alpha=0.9, label="median time in gradient synchronisation after backward")
    ax.set_yticks(y, names)
    ax.set(xlabel="time per training step (ms)", title=title)
    ax.grid(True, axis="x", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="lower center", ncols=2)
    return save(fig, path)


def bucket_sweep_figure(sweep: Sequence[StepRecord], references: dict[str, StepRecord], title: str, path: Path) -> Path:
    """Step time and exposed overhead against bucket size, other variants as horizontal lines."""
    x = np.array([r.bucket_size_mb for r in sweep])
    fig = Figure(figsize=WIDE)
    fig.subplots_adjust(**TWO_PANELS)
    ax_step, ax_exposed = fig.subplots(1, 2)
    median = np.array([r.median_step_s for r in sweep]) * 1e3
    spread = error_bars(median, np.array([r.min_step_s for r in sweep]) * 1e3,
                     np.array([r.max_step_s for r in sweep]) * 1e3)
    ax_step.errorbar(x, median, yerr=spread, fmt="o-", capsize=3, color="black", label="bucketed (ours)")
    exposed = np.array([r.exposed_overhead_s for r in sweep]) * 1e3
    intervals = [r.exposed_overhead_ci95_s for r in sweep]
    interval_bars = (error_bars(exposed, np.array([lo for lo, _ in intervals]) * 1e3,
                             np.array([hi for _, hi in intervals]) * 1e3) if all(intervals) else None)
    ax_exposed.errorbar(x, exposed, yerr=interval_bars, fmt="o-", capsize=3, color="black", label="bucketed (ours)")
    for i, (name, r) in enumerate(references.items()):
        color = f"C{i}"
        ax_step.axhline(r.median_step_s * 1e3, ls="--", color=color, label=name)
        if name != "compute-only":
            ax_exposed.axhline(r.exposed_overhead_s * 1e3, ls="--", color=color, label=name)
    ax_step.set(xscale="log", xlabel="bucket size (MB)", ylabel="median step time (ms)",
                title="step time (bars: min–max)")
    ax_exposed.set(xscale="log", xlabel="bucket size (MB)", ylabel="exposed overhead (ms)",
                   title="exposed overhead (bars: 95% interval)")
    for ax in (ax_step, ax_exposed):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def overhead_model_figure(
    prediction: OverheadPrediction, torch_ddp: StepRecord | None, title: str, path: Path
) -> Path:
    """Measured exposed overhead of the sweep beside the model's T(n_b), against the bucket count.

    The x axis is the bucket count, not the bucket cap: the model speaks of ``n_b`` equal
    buckets, and a cap larger than all gradients gives one bucket whatever its value.
    """
    p = prediction
    fig = Figure(figsize=(7.0, 4.2))
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.12, top=0.92)
    ax = fig.subplots()
    n_b = np.array([r.n_buckets for r, _ in p.rows], dtype=float)
    measured = np.array([r.exposed_overhead_s for r, _ in p.rows]) * 1e3
    ax.plot(n_b, measured, "o", color="black", label="measured exposed overhead (bucketed)")
    for (r, _), x, y in zip(p.rows, n_b, measured):
        ax.annotate(f"{r.bucket_size_mb:g} MB", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.plot(n_b, [t * 1e3 for _, t in p.rows], "s", color="tab:red",
            label="model T(n_b) at the measured bucket counts")
    most = p.s_bytes / p.largest_param_bytes if p.largest_param_bytes else max(n_b.max(), p.n_b_opt) * 2
    counts = np.geomspace(1.0, max(most, n_b.max(), 2.0), 200)
    ax.plot(counts, [p.predict(c) * 1e3 for c in counts], "-", color="tab:red", alpha=0.35, label="model T(n_b)")
    ax.axvline(p.s_bytes / p.b_opt_bytes, color="tab:green", ls=":",
               label=f"model optimum (buckets of {p.b_opt_bytes / MB:.3g} MB)")
    if torch_ddp is not None and torch_ddp.n_buckets:
        ax.plot([torch_ddp.n_buckets], [torch_ddp.exposed_overhead_s * 1e3], "D", color="tab:purple",
                label="measured exposed overhead (torch DDP)")
    ax.set(xscale="log", xlabel="number of buckets n_b", ylabel="time after backward (ms)", title=title)
    ax.margins(x=0.08)  # room for the bucket-size labels of the outermost points
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)
