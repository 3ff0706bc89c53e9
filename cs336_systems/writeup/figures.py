"""The writeup's plots, drawn with matplotlib's object API (no pyplot state) and saved reproducibly.

Reproducible: fixed size and dpi, and no "Software" tag in the PNG (matplotlib writes its
version there by default), so the same numbers give the same bytes on the same machine.
"""

from __future__ import annotations

from pathlib import Path
import numpy as np
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
