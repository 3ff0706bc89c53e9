"""The writeup's plots, drawn with matplotlib's object API (no pyplot state) and saved reproducibly.

Reproducible: fixed size and dpi, and no "Software" tag in the PNG (matplotlib writes its
version there by default), so the same numbers give the same bytes on the same machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from cs336_systems.writeup.analysis import CommGroup, OverheadPrediction, Record

MB = 2**20
DPI = 110
WIDE = (10.0, 4.0)  # inches: two panels side by side
TWO_PANELS = dict(left=0.07, right=0.98, bottom=0.13, top=0.85, wspace=0.25)


def error_bars(median: np.ndarray, low: np.ndarray, high: np.ndarray) -> list[np.ndarray]:
    """Error bar lengths below and above the median (clipped at 0 should a record disagree)."""
    return [np.clip(median - low, 0, None), np.clip(high - median, 0, None)]


def save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # bbox_inches="tight" would size the image from the text drawn; a fixed size keeps it stable
    # and avoids the cost of a layout engine.
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    return path


def allreduce_figure(groups: dict[CommGroup, list[Record]], title: str, path: Path) -> Path:
    """Median time (with p10–p90) and busbw against payload, one line per backend and world size."""
    fig = Figure(figsize=WIDE)
    fig.subplots_adjust(**TWO_PANELS)
    ax_time, ax_bw = fig.subplots(1, 2)
    for group, records in groups.items():
        x = np.array([r["payload_bytes"] for r in records]) / MB
        median = np.array([r["median_s"] for r in records]) * 1e3
        spread = error_bars(median, np.array([r["p10_s"] for r in records]) * 1e3,
                         np.array([r["p90_s"] for r in records]) * 1e3)
        style = "--" if group.shared_gpu else "-"
        line = ax_time.errorbar(x, median, yerr=spread, fmt="o" + style, capsize=3, label=group.label)
        ax_bw.plot(x, [r["busbw_gbps"] for r in records], "o" + style, color=line[0].get_color(), label=group.label)
    ax_time.set(xscale="log", yscale="log", xlabel="payload (MB)", ylabel="median time per all-reduce (ms)",
                title="time (bars: p10–p90)")
    ax_bw.set(xscale="log", xlabel="payload (MB)", ylabel="busbw (GB/s)", title="bus bandwidth")
    ax_bw.set_ylim(bottom=0)
    for ax in (ax_time, ax_bw):
        ax.grid(True, alpha=0.3)
    ax_bw.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def step_time_figure(records: Sequence[Record], title: str, path: Path) -> Path:
    """Median step time per variant (bars, min–max whiskers), the synchronisation phase shaded."""
    names = [r["variant"] for r in records]
    median = np.array([r["median_step_s"] for r in records]) * 1e3
    spread = error_bars(median, np.array([r["min_step_s"] for r in records]) * 1e3,
                     np.array([r["max_step_s"] for r in records]) * 1e3)
    sync = np.array([r["median_sync_s"] or 0.0 for r in records]) * 1e3
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


def bucket_sweep_figure(sweep: Sequence[Record], references: dict[str, Record], title: str, path: Path) -> Path:
    """Step time and exposed overhead against bucket size, other variants as horizontal lines."""
    x = np.array([r["bucket_size_mb"] for r in sweep])
    fig = Figure(figsize=WIDE)
    fig.subplots_adjust(**TWO_PANELS)
    ax_step, ax_exposed = fig.subplots(1, 2)
    median = np.array([r["median_step_s"] for r in sweep]) * 1e3
    spread = error_bars(median, np.array([r["min_step_s"] for r in sweep]) * 1e3,
                     np.array([r["max_step_s"] for r in sweep]) * 1e3)
    ax_step.errorbar(x, median, yerr=spread, fmt="o-", capsize=3, color="black", label="bucketed (ours)")
    exposed = np.array([r["exposed_overhead_s"] for r in sweep]) * 1e3
    intervals = [r.get("exposed_overhead_ci95_s") for r in sweep]
    interval_bars = (error_bars(exposed, np.array([lo for lo, _ in intervals]) * 1e3,
                             np.array([hi for _, hi in intervals]) * 1e3) if all(intervals) else None)
    ax_exposed.errorbar(x, exposed, yerr=interval_bars, fmt="o-", capsize=3, color="black", label="bucketed (ours)")
    for i, (name, r) in enumerate(references.items()):
        color = f"C{i}"
        ax_step.axhline(r["median_step_s"] * 1e3, ls="--", color=color, label=name)
        if name != "compute-only":
            ax_exposed.axhline(r["exposed_overhead_s"] * 1e3, ls="--", color=color, label=name)
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
    prediction: OverheadPrediction, torch_ddp: Record | None, title: str, path: Path
) -> Path:
    """Measured exposed overhead of the sweep beside the model's T(n_b), against the bucket count.

    The x axis is the bucket count, not the bucket cap: the model speaks of ``n_b`` equal
    buckets, and a cap larger than all gradients gives one bucket whatever its value.
    """
    p = prediction
    fig = Figure(figsize=(7.0, 4.2))
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.12, top=0.92)
    ax = fig.subplots()
    n_b = np.array([r["n_buckets"] for r, _ in p.rows], dtype=float)
    measured = np.array([r["exposed_overhead_s"] for r, _ in p.rows]) * 1e3
    ax.plot(n_b, measured, "o", color="black", label="measured exposed overhead (bucketed)")
    for (r, _), x, y in zip(p.rows, n_b, measured):
        ax.annotate(f"{r['bucket_size_mb']:g} MB", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.plot(n_b, [t * 1e3 for _, t in p.rows], "s", color="tab:red",
            label="model T(n_b) at the measured bucket counts")
    most = p.s_bytes / p.largest_param_bytes if p.largest_param_bytes else max(n_b.max(), p.n_b_opt) * 2
    counts = np.geomspace(1.0, max(most, n_b.max(), 2.0), 200)
    ax.plot(counts, [p.predict(c) * 1e3 for c in counts], "-", color="tab:red", alpha=0.35, label="model T(n_b)")
    ax.axvline(p.s_bytes / p.b_opt_bytes, color="tab:green", ls=":",
               label=f"model optimum (buckets of {p.b_opt_bytes / MB:.3g} MB)")
    if torch_ddp is not None and torch_ddp.get("n_buckets"):
        ax.plot([torch_ddp["n_buckets"]], [torch_ddp["exposed_overhead_s"] * 1e3], "D", color="tab:purple",
                label="measured exposed overhead (torch DDP)")
    ax.set(xscale="log", xlabel="number of buckets n_b", ylabel="time after backward (ms)", title=title)
    ax.margins(x=0.08)  # room for the bucket-size labels of the outermost points
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)
