"""The all-reduce benchmark's figure: time and busbw against payload, one line per group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from cs336_systems.bench.allreduce.record import AllReduceRecord
from cs336_systems.writeup.allreduce_analysis import CommGroup
from cs336_systems.writeup.figures import TWO_PANELS, WIDE, error_bars, log_scale, save


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
