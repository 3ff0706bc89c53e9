"""The whole writeup: built only from results files, complete, honest about gaps, reproducible.

The results tree is the one tests/test_writeup_ddp.py plants through the benchmarks' own writers
(all-reduce, naive-DDP check, step benchmark and ablation, profile, a one-GPU rehearsal), plus a
grade table as ``make test`` writes it and a smoke folder that must stay out. Each section has
its own tests of its sentences; these check what holds for the page as a whole. Nothing spawns
a process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from cs336_systems.problems import MEASURED, PROBLEMS, WRITTEN, GradeRecord
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import results_path
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.sections import SECTIONS, intro_section

from .test_writeup_allreduce import PAYLOADS, environment, record
from .test_writeup_ddp import TAG, build_results_tree, output_files

# One worker renders the shared tree once (the Makefile runs pytest with --dist loadgroup).
pytestmark = [pytest.mark.problem("beyond"), pytest.mark.xdist_group("writeup")]

SMOKE_TAG = "quick-smoke"
SMOKE_MEDIAN_S = 0.0456789  # only in the smoke folder: "45.7" ms must not be rendered
TIMESTAMP = "2031-01-02T03:04:05+00:00"
GRADES = [
    GradeRecord("naive_ddp", 23, 23, 0, 5.0, 5, {"tests/test_ddp_equivalence.py": [23, 23]}, []),
    GradeRecord("fsdp", 7, 8, 0, 13.1, 15, {"tests/test_fsdp.py": [7, 8]}, ["tests/test_fsdp.py::test_x[fp32]"]),
    GradeRecord("beyond", 300, 300, 1, None, None, {"tests/test_bad_inputs.py": [250, 250],
                                                    "tests/test_signals.py": [5, 5]}, []),
]


def plant_extras(results: Path) -> None:
    """A smoke run the writeup must skip and the grade table of a test run."""
    smoke = [record("gloo", "cpu", 2, payload, [SMOKE_MEDIAN_S] * 3) for payload in PAYLOADS]
    write_results(results / SMOKE_TAG / "allreduce.json", ResultsFile("allreduce", environment(), {}, smoke))
    env = environment()
    write_results(results_path(GradeRecord.KIND, TAG, root=results),
                  ResultsFile(GradeRecord.KIND, env, {"pytest_args": ["-n", "auto"]}, GRADES))


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("writeup")
    results = build_results_tree(root)
    plant_extras(results)
    first = render_writeup(results, root / "a")
    render_writeup(results, root / "b")
    return {"root": root, "results": results, "first": first, "readme": first.readme.read_text()}


def test_rendering_twice_gives_byte_identical_files(rendered):
    a, b = output_files(rendered["root"] / "a"), output_files(rendered["root"] / "b")
    assert sorted(a) == sorted(b)
    assert {"README.md", "writeup.ipynb"} <= set(a)
    assert sum(name.startswith("figures/") for name in a) >= 5
    for name in a:
        assert a[name] == b[name], f"{name} differs between two renders of the same results"


def test_stale_figures_are_removed(rendered, tmp_path):
    stale = tmp_path / "figures" / "from-a-machine-that-is-gone.png"
    stale.parent.mkdir()
    stale.write_bytes(b"old")
    render_writeup(rendered["results"], tmp_path, sections=[intro_section])
    assert not stale.exists()


def test_every_problem_that_asks_for_prose_has_a_section(rendered):
    headings = [line for line in rendered["readme"].splitlines() if line.startswith("## ")]
    for problem in PROBLEMS:
        if problem.deliverable in (MEASURED, WRITTEN):
            assert any(re.match(rf"## {problem.name}\b", h) for h in headings), f"no section for {problem.name}"


def test_the_problem_map_reads_the_grade_table(rendered):
    readme = rendered["readme"]
    table = readme.split("## The handout's problems")[1].split("\n## ")[0]
    assert "| `naive_ddp` | 5 |" in table and "23/23 passed" in table and "7/8 passed" in table
    assert "`tests/test_fsdp.py::test_x[fp32]`" in table  # a failing test is named
    assert "`tests/test_bad_inputs.py`: 250 bad values" in table and "250 of 250 passed" in table


def test_settings_are_named_and_no_time_of_rendering_leaks(rendered):
    readme = rendered["readme"]
    assert "logical cores" in readme and "torch " in readme and "commit " in readme
    assert TIMESTAMP not in readme and "2031" not in readme


def test_unmeasured_gpu_settings_say_so_with_the_command(rendered):
    readme = rendered["readme"]
    assert "not measured here" in readme and "`make bench-gpu`" in readme


def test_smoke_folders_are_left_out_unless_asked_for(rendered, tmp_path):
    smoke_ms = f"{SMOKE_MEDIAN_S * 1e3:.1f}"
    assert SMOKE_TAG not in rendered["readme"] and smoke_ms not in rendered["readme"]
    included = render_writeup(rendered["results"], tmp_path / "out", include_tags=[SMOKE_TAG],
                              sections=[intro_section]).readme.read_text()
    assert f"`{SMOKE_TAG}`" in included


def test_notebook_validates_and_carries_the_readme(rendered):
    nb = nbformat.read(rendered["first"].notebook, as_version=4)
    nbformat.validate(nb)
    assert [c.id for c in nb.cells] == [f"cell-{i:04d}" for i in range(1, len(SECTIONS) + 1)]
    assert all(c.cell_type == "markdown" for c in nb.cells)
    assert "\n\n".join(c.source for c in nb.cells) + "\n" == rendered["readme"]
    assert rendered["first"].notebook.read_bytes().endswith(b"\n")


def test_figures_are_linked_relative_to_the_writeup(rendered):
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", rendered["readme"])
    assert links and all(link.startswith("figures/") for link in links)
    for link in links:
        assert (rendered["root"] / "a" / link).is_file()


def test_no_results_at_all_renders_every_gap_with_its_command(tmp_path):
    readme = render_writeup(tmp_path / "no-results", tmp_path / "out").readme.read_text()
    for problem in PROBLEMS:
        if problem.deliverable == MEASURED:
            assert f"## {problem.name}" in readme
    assert "make bench-gpu" in readme and "`make bench`" in readme and "`make test`" in readme
    assert not re.search(r"\d+\.\d+ ms", readme)  # not a single measured time


@pytest.mark.parametrize("damage", ["truncated", "not-results", "other-version"])
def test_an_unreadable_results_file_is_named_and_the_rest_renders(rendered, tmp_path, damage):
    results = build_results_tree(tmp_path)
    path = results / TAG / "allreduce.json"
    if damage == "truncated":  # what a run killed while writing would leave, were files not renamed into place
        path.write_text(path.read_text()[:200])
    elif damage == "not-results":
        path.write_text('["not", "records"]\n')
    else:
        document = json.loads(path.read_text())
        document["version"] = 99
        path.write_text(json.dumps(document))
    readme = render_writeup(results, tmp_path / "out").readme.read_text()
    assert f"Unreadable: `{TAG}/allreduce.json`, set aside" in readme
    assert str(tmp_path) not in readme  # no path of the machine that rendered it
    assert "## naive_ddp_benchmarking" in readme and re.search(r"\d+\.\d+", readme.split("## naive_ddp_benchmarking")[1])
