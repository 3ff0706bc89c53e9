"""What a page function gets (the loaded results and where to put figures) and what it gives back.

The extension point of the writeup: a page is any function ``(RenderContext) -> Page``;
``cs336_systems.writeup.pages.PAGES`` lists them in reading order. A page is one details file
(``writeup/details/<name>.md``) plus the answers, one per handout problem, that it measures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from cs336_systems.writeup.load import WriteupInputs

FIGURES_DIR = "figures"
DETAILS_DIR = "details"


@dataclass(frozen=True)
class Gap:
    """A setting a page would report on but no results file measured."""

    setting: str  # coverage.Setting.name, e.g. "NCCL on GPUs"
    what: str  # what is missing, e.g. "the all-reduce benchmark"
    command: str  # the Make target that measures it


@dataclass
class Page:
    """A details page (``markdown`` starts with its ``#`` title), the answers it gives and its figures."""

    name: str  # the file stem under writeup/details/
    markdown: str
    answers: dict[str, str] = field(default_factory=dict)  # problem name -> its answer, without heading
    figures: list[Path] = field(default_factory=list)


@dataclass
class RenderContext:
    """The loaded results, and where the rendered writeup (and so its figures) will live."""

    inputs: WriteupInputs
    out_dir: Path
    gaps: list[Gap] = field(default_factory=list)  # filled by the pages, listed once per setting

    def not_measured(self, setting: str, what: str, command: str) -> None:
        """Record a gap; the machines page lists every gap once, grouped by setting."""
        gap = Gap(setting, what, command)
        if gap not in self.gaps:
            self.gaps.append(gap)

    @property
    def figures_dir(self) -> Path:
        return self.out_dir / FIGURES_DIR

    def figure_path(self, name: str) -> Path:
        """Where a figure called ``name`` (a file name, e.g. "allreduce-<tag>.png") goes."""
        if "/" in name or name.startswith("."):
            raise ValueError(f"figure name must be a plain file name, got {name!r}")
        return self.figures_dir / name

    def link(self, path: Path) -> str:
        """``path`` as a details page links to it (relative to ``details/``, forward slashes)."""
        return Path(os.path.relpath(path, self.out_dir / DETAILS_DIR)).as_posix()

    def image(self, path: Path, alt: str) -> str:
        """An image on a details page."""
        return f"![{alt}]({self.link(path)})"

    def answer_image(self, path: Path, alt: str) -> str:
        """An image in the README's answers (relative to the writeup folder)."""
        return f"![{alt}]({Path(os.path.relpath(path, self.out_dir)).as_posix()})"

    @property
    def results_label(self) -> str:
        """The results root as the README finds it: relative to the writeup folder when inside it, else its name."""
        root = self.inputs.results_root.resolve()
        return root.relative_to(self.out_dir.resolve()).as_posix() if root.is_relative_to(self.out_dir.resolve()) \
            else root.name


PageFn = Callable[[RenderContext], Page]


def details_link(page: str, anchor: str = "") -> str:
    """A link target from the README to a details page (details pages link to each other by file name)."""
    return f"{DETAILS_DIR}/{page}.md" + (f"#{anchor}" if anchor else "")
