"""The writeup's plots, drawn with matplotlib's object API (no pyplot state) and saved reproducibly.

Reproducible: fixed size and dpi, and no "Software" tag in the PNG (matplotlib writes its
version there by default), so the same numbers give the same bytes on the same machine. On another
CPU too: numpy's ``log10`` and ``power`` round differently there (an AVX-512 kernel on one CPU,
another on the next), and matplotlib's own log axis let that last bit move a spine end lying on a
half pixel to the other pixel (issue 34). :func:`log_scale` draws log axes from positions rounded
to a millionth of a decade instead (tests/test_writeup_reproducible.py plays the other CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import matplotlib.style
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.scale import LogScale, LogTransform
from matplotlib.transforms import Transform

from cs336_systems.results.files import atomic_path

DPI = 110
WIDE = (10.0, 4.0)  # inches: two panels side by side
TWO_PANELS = dict(left=0.07, right=0.98, bottom=0.13, top=0.85, wspace=0.25)
LOG_DECIMALS = 6  # decimals of a decade kept: 1e-6 decade is under 1e-3 pixel here, 1e10 ulps of log10


class _SettledLogTransform(LogTransform):
    """``log10`` rounded to LOG_DECIMALS: its last bit, which differs between CPUs, never reaches a pixel."""

    def transform_non_affine(self, values):
        return np.round(super().transform_non_affine(values), LOG_DECIMALS)


class SettledLogScale(LogScale):
    """matplotlib's base-10 log scale (its ticks, labels, clipping) drawn from settled positions."""

    name = "settled-log"

    def __init__(self, axis=None) -> None:
        super().__init__(axis, base=10)
        self._settled = _SettledLogTransform(10)

    def get_transform(self) -> Transform:
        return self._settled


def log_scale(ax: Axes, which: str) -> None:
    """A base-10 log scale on ``ax``'s ``which`` axis ("x" or "y") whose positions do not depend on the CPU."""
    getattr(ax, f"set_{which}scale")(SettledLogScale())


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
