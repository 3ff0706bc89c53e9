"""The FSDP timelines, one panel per FSDP (ours, torch's) on a shared time axis, from one traced step.

Lanes, top to bottom: phases; compute; waiting (blocked in a collective's ``wait``: communication not
hidden); one lane per kind of collective, each bar from launch to completion. A collective bar beside a
compute bar is communication hidden behind computation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from matplotlib.patches import Patch

from cs336_systems.bench.fsdp.record import COLLECTIVES, FsdpTimeline
from cs336_systems.writeup.figures import timeline_panels

PHASE_COLORS = {"forward": "#9ecae1", "backward": "#a1d99b", "finish": "#fdae6b", "optimizer_step": "#bcbddc"}
COMPUTE_COLOR, WAIT_COLOR = "#31a354", "#fd8d3c"
COLLECTIVE_COLORS = {"all_gather": "#3182bd", "reduce_scatter": "#de2d26", "all_reduce": "#756bb1",
                     "broadcast": "#636363"}
ROW_HEIGHT_IN = 3.0  # inches per timeline


def _bars(intervals: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    """(start, width) in ms, as ``broken_barh`` wants them."""
    return [(a * 1e3, (b - a) * 1e3) for a, b in intervals]


def _draw(ax, title: str, timeline: FsdpTimeline, bottom: bool) -> None:
    kinds = [k for k in COLLECTIVES if timeline.collectives.get(k)]
    lanes = [*(k.replace("_", "-") for k in reversed(kinds)), "waiting", "compute", "phase"]
    for i, kind in enumerate(reversed(kinds)):
        calls = timeline.collectives[kind]
        # Alternate calls between two half-height rows, so that calls in flight together stay apart.
        for parity in (0, 1):
            ax.broken_barh(_bars(calls[parity::2]), (i - 0.35 + 0.36 * (1 - parity), 0.34),
                           facecolor=COLLECTIVE_COLORS[kind], edgecolor="white", linewidth=0.3)
    ax.broken_barh(_bars(timeline.waits), (len(kinds) - 0.35, 0.7), facecolor=WAIT_COLOR)
    compute_lane = len(kinds) + 1
    ax.broken_barh(_bars(timeline.compute), (compute_lane - 0.35, 0.7), facecolor=COMPUTE_COLOR)
    for name, span in timeline.phases.items():
        ax.broken_barh(_bars([span]), (compute_lane + 0.6, 0.8), facecolor=PHASE_COLORS.get(name, "0.8"),
                       edgecolor="0.3", linewidth=0.5)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_title(f"{title}: traced step {timeline.duration_s * 1e3:.0f} ms (median timed step "
                 f"{timeline.timed_median_s * 1e3:.0f} ms)", fontsize=9, loc="left")
    if bottom:
        handles = [Patch(facecolor=c, label=n.replace("_", " ")) for n, c in PHASE_COLORS.items()]
        handles += [Patch(facecolor=COMPUTE_COLOR, label="compute"), Patch(facecolor=WAIT_COLOR, label="waiting")]
        handles += [Patch(facecolor=c, label=k.replace("_", "-")) for k, c in COLLECTIVE_COLORS.items()]
        ax.legend(handles=handles, loc="upper right", bbox_to_anchor=(1.0, -0.25), fontsize=7, ncol=9,
                  frameon=False)
        ax.set_xlabel("time since the step started (ms)", fontsize=8)


def render_fsdp_timelines(timelines: Sequence[tuple[str, FsdpTimeline]], path: Path) -> Path:
    """A PNG with one panel per (title, timeline), top to bottom, on a shared time axis."""
    return timeline_panels(timelines, _draw, lambda t: t.duration_s * 1e3, path, ROW_HEIGHT_IN)
