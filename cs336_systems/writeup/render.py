"""Rendering the sections into ``README.md`` and the same content as ``writeup.ipynb``.

Written atomically (a temporary file renamed into place), so an interrupted render leaves the
previous writeup whole. Reproducible by construction: sections see results in sorted order, figures are saved without
metadata, stale figures are removed first, the notebook's cell ids are numbered
("cell-0001", ...) instead of random, and nothing records the time of rendering. The same
results therefore give byte-identical files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import nbformat

from cs336_systems.results.files import write_atomic
from cs336_systems.writeup.context import RenderContext, Section, SectionFn
from cs336_systems.writeup.load import load_results
from cs336_systems.writeup.sections import SECTIONS

README = "README.md"
NOTEBOOK = "writeup.ipynb"


@dataclass(frozen=True)
class RenderedWriteup:
    readme: Path
    notebook: Path
    figures: list[Path]


def build_notebook(sections: Sequence[Section]) -> nbformat.NotebookNode:
    """One markdown cell per section, with deterministic ids; validated against the nbformat schema."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell(s.markdown.strip(), id=f"cell-{i:04d}") for i, s in enumerate(sections, start=1)
    ]
    nb.metadata = {"language_info": {"name": "python"}}
    nbformat.validate(nb)
    return nb


def _clear_figures(figures_dir: Path) -> None:
    # Figures of machines or sections that no longer exist must not linger between renders.
    if figures_dir.is_dir():
        for png in sorted(figures_dir.glob("*.png")):
            png.unlink()


def render_writeup(
    results_root: Path,
    out_dir: Path,
    include_tags: Iterable[str] = (),
    sections: Sequence[SectionFn] = tuple(SECTIONS),
) -> RenderedWriteup:
    """Render every section from the results under ``results_root`` into ``out_dir``."""
    out_dir = Path(out_dir)
    inputs = load_results(Path(results_root), include_tags)
    ctx = RenderContext(inputs, out_dir)
    _clear_figures(ctx.figures_dir)
    rendered = [section(ctx) for section in sections]
    figures = [path for s in rendered for path in s.figures]
    missing = [str(p) for p in figures if not p.is_file()]
    if missing:
        raise RuntimeError(f"sections returned figures that were not written: {missing}")
    out_dir.mkdir(parents=True, exist_ok=True)
    readme = out_dir / README
    write_atomic(readme, "\n\n".join(s.markdown.strip() for s in rendered) + "\n")
    notebook = out_dir / NOTEBOOK
    text = nbformat.writes(build_notebook(rendered))
    write_atomic(notebook, text if text.endswith("\n") else text + "\n")
    return RenderedWriteup(readme, notebook, figures)
