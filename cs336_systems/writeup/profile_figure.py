"""The profiler's timelines (problem 5b) from the intervals ``profile.json`` stores: per variant the phases,
backward compute and the all-reduces, with backward's window shaded across the three lanes."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from matplotlib.patches import Patch

from cs336_systems.bench.profile.timeline import Interval, StepTimeline
from cs336_systems.writeup.figures import timeline_panels

PHASE_STYLE = {  # label and colour of each phase bar
    "forward": ("forward", "#9ecae1"),
    "backward": ("backward", "#a1d99b"),
    "finish_gradient_synchronization": ("finish_gradient_synchronization", "#fdae6b"),
    "optimizer_step": ("optimizer step", "#bcbddc"),
}
COMPUTE_COLOR, COMM_COLOR, WINDOW_COLOR = "#31a354", "#de2d26", "0.92"
LANES = ("communication\n(all-reduce)", "backward\ncompute", "phase")  # bottom to top
ROW_HEIGHT_IN = 2.9  # inches per timeline
MS_PER_US = 1e-3


def _bars(intervals: Iterable[Interval]) -> list[tuple[float, float]]:
    """(start, width) in ms, as ``broken_barh`` wants them."""
    return [(a * MS_PER_US, (b - a) * MS_PER_US) for a, b in intervals]


def _draw_timeline(ax, title: str, timeline: StepTimeline, bottom: bool) -> None:
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
        f"(all-reduce {timeline.communication_us * MS_PER_US:.1f} ms over {timeline.n_comm_events} profiler events, "
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
    return timeline_panels(timelines, _draw_timeline, lambda t: t.duration_us * MS_PER_US, path, ROW_HEIGHT_IN)
