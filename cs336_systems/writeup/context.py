"""What a section gets (the loaded results and where to put figures) and what it gives back.

The extension point of the writeup: a section is any function ``(RenderContext) -> Section``;
``cs336_systems.writeup.sections.SECTIONS`` lists them in reading order.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from cs336_systems.writeup.load import WriteupInputs

FIGURES_DIR = "figures"


@dataclass
class Section:
    """A section's markdown (starting with its ``##`` heading) and the figures it wrote."""

    markdown: str
    figures: list[Path] = field(default_factory=list)


@dataclass
class RenderContext:
    """The loaded results, and where the rendered writeup (and so its figures) will live."""

    inputs: WriteupInputs
    out_dir: Path

    @property
    def figures_dir(self) -> Path:
        return self.out_dir / FIGURES_DIR

    def figure_path(self, name: str) -> Path:
        """Where a figure called ``name`` (a file name, e.g. "allreduce-<tag>.png") goes."""
        if "/" in name or name.startswith("."):
            raise ValueError(f"figure name must be a plain file name, got {name!r}")
        return self.figures_dir / name

    def link(self, path: Path) -> str:
        """``path`` relative to the writeup, as markdown wants it (forward slashes)."""
        return Path(os.path.relpath(path, self.out_dir)).as_posix()

    def image(self, path: Path, alt: str) -> str:
        return f"![{alt}]({self.link(path)})"

    def copy_figure(self, source: Path, name: str) -> Path:
        """Copy an image made elsewhere (the profiler's) next to ours, so links stay inside the writeup."""
        target = self.figure_path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        return target

    @property
    def results_label(self) -> str:
        """The results root as a reader should find it: relative to the writeup's parent when inside it."""
        root = self.inputs.results_root.resolve()
        base = self.out_dir.resolve().parent
        try:
            return root.relative_to(base).as_posix()
        except ValueError:
            return root.name


SectionFn = Callable[[RenderContext], Section]
