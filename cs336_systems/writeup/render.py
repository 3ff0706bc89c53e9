"""Rendering the pages into ``README.md`` (header and answers), ``details/*.md`` and ``writeup.ipynb``.

``README.md`` is the header and ``## Answers``: one subsection per handout problem, in the
handout's order, each joined from the answers the pages give (templates/README.md.j2). Each
page's long form goes to ``details/<name>.md``. The notebook carries the same content, answers
first. Every file is written atomically (a temporary file renamed into place), so an
interrupted render leaves the previous writeup whole, and reproducibly: pages see results in
sorted order, figures are saved without metadata, stale figures and pages are removed first,
the notebook's cell ids are numbered, and nothing records the time of rendering.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import nbformat

from cs336_systems.problems import PROBLEMS
from cs336_systems.results.files import write_atomic
from cs336_systems.writeup import templating
from cs336_systems.writeup.context import DETAILS_DIR, Page, PageFn, RenderContext
from cs336_systems.writeup.load import load_results

README = "README.md"
NOTEBOOK = "writeup.ipynb"


@dataclass(frozen=True)
class RenderedWriteup:
    readme: Path
    notebook: Path
    details: list[Path]
    figures: list[Path]

    def text(self) -> str:
        """Every details page, then README.md, as one string (what a test searches)."""
        return "\n\n".join(p.read_text() for p in [*self.details, self.readme])


def _relinked(markdown: str) -> str:
    """A details page's relative links made relative to the writeup folder (for the notebook)."""
    def fix(match: re.Match) -> str:
        return f"]({posixpath.normpath(posixpath.join(DETAILS_DIR, match.group(1)))})"
    return re.sub(r"\]\((?![a-z]+:|#|/)([^)\s]+)\)", fix, markdown)


def build_notebook(header: str, answers: Sequence[str], pages: Sequence[Page]) -> nbformat.NotebookNode:
    """Header, one cell per answer, one per details page; deterministic ids; validated by nbformat."""
    texts = [header, *answers, *(_relinked(p.markdown) for p in pages)]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(t.strip(), id=f"cell-{i:04d}") for i, t in enumerate(texts, start=1)]
    nb.metadata = {"language_info": {"name": "python"}}
    nbformat.validate(nb)
    return nb


def _clear(folder: Path, pattern: str) -> None:
    # Figures and pages of machines or topics that no longer exist must not linger between renders.
    if folder.is_dir():
        for path in sorted(folder.glob(pattern)):
            path.unlink()


def heading(name: str) -> str:
    """An answer's heading: the problem and the handout editions it belongs to, under an explicit
    anchor named after the problem alone (what every page links to)."""
    editions = next(p.editions for p in PROBLEMS if p.name == name)
    which = " and ".join(editions) + (" handouts" if len(editions) > 1 else " handout")
    return f'<a id="{name}"></a>\n### {name} ({which})'


def _answers(pages: Sequence[Page], only_given: bool) -> list[tuple[str, str]]:
    """(problem, answer) in the handout's order; the whole writeup must answer every problem."""
    stray = sorted({name for page in pages for name in page.answers} - {p.name for p in PROBLEMS})
    if stray:
        raise ValueError(f"answers to problems the handout does not have: {stray}")
    out = [(p.name, "\n\n".join(page.answers[p.name].strip() for page in pages if p.name in page.answers))
           for p in PROBLEMS]
    if not only_given and (missing := [name for name, text in out if not text]):
        raise ValueError(f"no page answers {missing}")
    return [(name, text) for name, text in out if text]


def render_writeup(
    results_root: Path,
    out_dir: Path,
    include_tags: Iterable[str] = (),
    pages: Sequence[PageFn] | None = None,
) -> RenderedWriteup:
    """Render every page from the results under ``results_root`` into ``out_dir``.

    ``pages`` defaults to :data:`~cs336_systems.writeup.pages.PAGES`, the whole writeup, which
    must answer every problem; given a subset (a test of one page), the README holds only the
    answers those pages give.
    """
    from cs336_systems.writeup.pages import PAGES

    whole = pages is None
    out_dir = Path(out_dir)
    inputs = load_results(Path(results_root), include_tags)
    ctx = RenderContext(inputs, out_dir)
    _clear(ctx.figures_dir, "*.png")
    rendered = [page(ctx) for page in (PAGES if pages is None else pages)]
    figures = [path for p in rendered for path in p.figures]
    missing = [str(p) for p in figures if not p.is_file()]
    if missing:
        raise RuntimeError(f"pages returned figures that were not written: {missing}")
    answers = _answers(rendered, only_given=not whole)
    readme_text = templating.render(
        "README.md.j2", results=ctx.results_label, answers=[(heading(name), text) for name, text in answers],
        pages=[(p.name, p.markdown.splitlines()[0].lstrip("# ").strip()) for p in rendered],
        details_dir=DETAILS_DIR)
    details_dir = out_dir / DETAILS_DIR
    details_dir.mkdir(parents=True, exist_ok=True)
    _clear(details_dir, "*.md")
    details = [write_atomic(details_dir / f"{p.name}.md", p.markdown.strip() + "\n") for p in rendered]
    readme = out_dir / README
    write_atomic(readme, readme_text)
    header, _, _ = readme_text.partition("\n## Answers")
    answer_cells = [f"{heading(name)}\n\n{text}" for name, text in answers]
    notebook = out_dir / NOTEBOOK
    text = nbformat.writes(build_notebook(header + "\n\n## Answers", answer_cells, rendered))
    write_atomic(notebook, text if text.endswith("\n") else text + "\n")
    return RenderedWriteup(readme, notebook, details, figures)
