"""The writeup's plots, drawn with matplotlib's object API (no pyplot state) and saved reproducibly.

Reproducible: fixed size and dpi, and no "Software" tag in the PNG (matplotlib writes its
version there by default), so the same numbers give the same bytes on the same machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import matplotlib.style
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from cs336_systems.results.files import atomic_path

DPI = 110
WIDE = (10.0, 4.0)  # inches: two panels side by side
TWO_PANELS = dict(left=0.07, right=0.98, bottom=0.13, top=0.85, wspace=0.25)


def error_bars(median: np.ndarray, low: np.ndarray, high: np.ndarray) -> list[np.ndarray]:
    """Error bar lengths below and above the median (clipped at 0 should a record disagree)."""
    return [np.clip(median - low, 0, None), np.clip(high - median, 0, None)]


def save(fig: Figure, path: Path) -> Path:
    """Write ``fig`` as a PNG, atomically, with no metadata (the same figure gives the same bytes)."""
    # bbox_inches="tight" would size the image from the text drawn; a fixed size keeps it stable
    # and avoids the cost of a layout engine.
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI, metadata={"Software": None})
    return path


def timeline_panels(timelines: Sequence[tuple[str, Any]], draw: Callable[[Axes, str, Any, bool], None],
                    duration_ms: Callable[[Any], float], path: Path, row_height_in: float) -> Path:
    """A PNG with one timeline per (title, timeline), top to bottom, on a shared time axis from 0
    to the longest one; ``draw(ax, title, timeline, is_bottom)`` draws one panel."""
    if not timelines:
        raise ValueError("no timeline to draw")
    # The default style whatever the caller's rcParams, so the same timelines give the same bytes.
    with matplotlib.style.context("default"):
        fig = Figure(figsize=(11.0, row_height_in * len(timelines)), layout="constrained")
        axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False)[:, 0]
        for i, (ax, (title, timeline)) in enumerate(zip(axes, timelines)):
            draw(ax, title, timeline, i == len(timelines) - 1)
        axes[0].set_xlim(0, max(duration_ms(t) for _, t in timelines))
        return save(fig, Path(path))
