"""The profiler's timelines (problem 5b), drawn from the intervals ``profile.json`` stores.

One row per variant on a shared time axis: the step's phases on top, backward compute in the
middle, the all-reduces at the bottom, with backward's window shaded across all three, so a
reader sees at a glance which all-reduces ran while backward was still computing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import matplotlib.style
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from cs336_systems.bench.profile.timeline import Interval, StepTimeline
from cs336_systems.writeup.figures import save

PHASE_STYLE = {  # label and colour of each phase bar
    "forward": ("forward", "#9ecae1"),
    "backward": ("backward", "#a1d99b"),
    "finish_gradient_synchronization": ("finish_gradient_synchronization", "#fdae6b"),
    "optimizer_step": ("optimizer step", "#bcbddc"),
}
COMPUTE_COLOR, COMM_COLOR, WINDOW_COLOR = "#31a354", "#de2d26", "0.92"
LANES = ("communication\n(all-reduce)", "backward\ncompute", "phase")  # bottom to top
ROW_HEIGHT_IN, WIDTH_IN = 2.9, 11.0
MS_PER_US = 1e-3


def _bars(intervals: Iterable[Interval]) -> list[tuple[float, float]]:
    """(start, width) in ms, as ``broken_barh`` wants them."""
    return [(a * MS_PER_US, (b - a) * MS_PER_US) for a, b in intervals]


def _draw_timeline(ax, timeline: StepTimeline, title: str, bottom: bool) -> None:
    b0, b1 = timeline.backward_range
    # The backward window across every lane: communication inside it is overlapped.
    ax.axvspan(b0 * MS_PER_US, b1 * MS_PER_US, color=WINDOW_COLOR, zorder=0)
    for name, span in timeline.phases.items():
        ax.broken_barh(_bars([span]), (1.6, 0.8), facecolor=PHASE_STYLE[name][1], edgecolor="0.3", linewidth=0.5)
    ax.broken_barh(_bars(timeline.backward_compute), (0.65, 0.7), facecolor=COMPUTE_COLOR)
    ax.broken_barh(_bars(timeline.communication), (-0.35, 0.7), facecolor=COMM_COLOR)
    ax.set_yticks(range(len(LANES)), LANES)
    ax.set_ylim(-0.6, 2.6)
    ax.set_title(
        f"{title}: {timeline.overlap_fraction:.0%} of all-reduce time inside backward "
        f"(all-reduce {timeline.communication_us * MS_PER_US:.1f} ms in {timeline.n_comm_events} calls, "
        f"backward {timeline.backward_us * MS_PER_US:.1f} ms)",
        fontsize=9,
        loc="left",
    )
    if bottom:  # one legend and axis label per figure, under the lowest timeline
        handles = [Patch(facecolor=color, label=label) for label, color in PHASE_STYLE.values()]
        handles.append(Patch(facecolor=WINDOW_COLOR, label="backward window"))
        ax.legend(handles=handles, loc="upper right", bbox_to_anchor=(1.0, -0.22), fontsize=7, ncol=5,
                  frameon=False)
        ax.set_xlabel("time since the step started (ms)", fontsize=8)


def render_timelines(timelines: Sequence[tuple[str, StepTimeline]], path: Path) -> Path:
    """A PNG with one timeline per (title, timeline), top to bottom, on a shared time axis."""
    if not timelines:
        raise ValueError("no timeline to draw")
    # The default style whatever the caller's rcParams, so the same timelines give the same bytes.
    with matplotlib.style.context("default"):
        fig = Figure(figsize=(WIDTH_IN, ROW_HEIGHT_IN * len(timelines)), layout="constrained")
        axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False)[:, 0]
        for i, (ax, (title, timeline)) in enumerate(zip(axes, timelines)):
            _draw_timeline(ax, timeline, title, bottom=i == len(timelines) - 1)
        axes[0].set_xlim(0, max(t.duration_us for _, t in timelines) * MS_PER_US)
        return save(fig, Path(path))
