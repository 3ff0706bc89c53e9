"""Issue 59: the committed pages say what their files say.

Every check reads the committed pages and the raw JSON of the files they cite (not the renderer's
records), so a page that outlives its file, a load phrase written into a template, or a grade line
whose run moved on fails here.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from cs336_systems.results.files import write_atomic
from cs336_systems.results.paths import RESULTS_ROOT

pytestmark = pytest.mark.problem("beyond")
REPO = Path(__file__).resolve().parents[1]
WRITEUP = REPO / "writeup"
PAGES = [WRITEUP / "README.md", *sorted((WRITEUP / "details").glob("*.md"))]
CITED = re.compile(r"`([\w.-]+/[\w./-]+\.json(?:\.gz)?)`")  # `<machine tag>/<file>`, as setting lines cite


def _pages() -> dict[str, str]:
    return {p.relative_to(WRITEUP).as_posix(): p.read_text() for p in PAGES}


def _raw(source: str) -> dict:
    return json.loads((RESULTS_ROOT / source).read_text())


def _exists(name: str) -> bool:
    """A name under a machine tag (`cpu2-…/x.json`, `1xnvidia-h200/x.json`) must be that file of the
    results; another (the machines table's `profile/profile.json`) a file of the repository or of a
    machine folder."""
    if re.match(r"(cpu\d+-|\d+x)", name):
        return (RESULTS_ROOT / name).is_file()
    return (REPO / name).is_file() or any((folder / name).is_file() for folder in RESULTS_ROOT.iterdir())


def test_every_results_file_a_page_names_exists():
    named = {(page, m) for page, text in _pages().items() for m in CITED.findall(text) if "<" not in m}
    assert len(named) > 20  # the setting lines of every page
    missing = sorted((page, m) for page, m in named if not _exists(m))
    assert not missing, f"pages name files that are not there: {missing}"


SETTING = re.compile(r"^\*Setting: (.*)\.\*$", re.M)
LOAD = re.compile(r"load (\d+\.\d) before, (\d+\.\d) after on (\d+) cores, (other jobs (\d+\.\d\d) runnable|"
                  r"other jobs not counted)")


def test_no_load_phrase_contradicts_its_file():
    """Every setting line's load against its file's recorded load, read from the JSON: the numbers,
    "load not recorded" only where none is, "other jobs not counted" only where no count is; and no
    page says a file it cites recorded no load when it did."""
    checked = 0
    for page, text in _pages().items():
        for line in SETTING.findall(text):
            sources = CITED.findall(line)
            if len(sources) != 1:
                continue
            load = _raw(sources[0])["environment"].get("load")
            found = LOAD.search(line)
            if load is None:
                assert "load not recorded" in line and not found, (page, line)
                continue
            assert found and "load not recorded" not in line, (page, line)
            before, after, cores, _, others = found.groups()
            assert (float(before), float(after), int(cores)) == (
                round(load["before"], 1), round(load["after"], 1), load["cores"]), (page, line)
            assert (others is None) == (load.get("others") is None), (page, line)
            if others is not None:
                assert float(others) == round(load["others"], 2), (page, line)
            checked += 1
        for sentence in re.split(r"(?<=[.;])\s", text):
            if re.search(r"neither recorded its load|recorded no load|load not recorded", sentence):
                for source in CITED.findall(sentence):
                    assert _raw(source)["environment"].get("load") is None, (page, sentence[:200])
    assert checked > 15


def test_the_grade_lines_name_the_commit_of_their_grades_file():
    text = (WRITEUP / "README.md").read_text()
    env = _raw("cpu2-intel-xeon-processor/grades.json")["environment"]
    lines = re.findall(r"^\d+/\d+ passed in (.*) \(\[grade table\]", text, flags=re.M)
    assert len(lines) >= 5
    assert set(lines) == {f"`make test` at commit {env['git_commit'][:7]}"}


def test_every_answer_that_says_busbw_defines_it():
    from tests.test_writeup_ddp import answers

    for problem, text in answers((WRITEUP / "README.md").read_text()).items():
        if "busbw" in text:
            assert "bus bandwidth: payload / time · 2(n−1)/n" in text, problem


def test_rendered_and_results_files_are_written_0644_whatever_the_umask(tmp_path):
    """mkstemp makes its files 0600; git has every page, figure and results file 0644."""
    from cs336_systems.writeup import render_writeup
    from cs336_systems.writeup.allreduce_section import allreduce_page
    from cs336_systems.writeup.pages import machines_page

    old = os.umask(0o077)
    try:
        out = render_writeup(RESULTS_ROOT, tmp_path / "out", pages=[allreduce_page, machines_page])
        plain = write_atomic(tmp_path / "x.json", "{}\n")
    finally:
        os.umask(old)
    written = [out.readme, out.notebook, *out.details, *out.figures, plain]
    assert out.figures and len(out.details) == 2
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in written} == {p.name: 0o644 for p in written}
