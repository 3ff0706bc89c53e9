"""What staff and students read, from grades written by the grader's own writers (no grading):
the folder's summary.md, summary.png and grades.csv, and results.json's student-facing output.

Each submission's grade is written by ``report.write_outputs``, as the harness writes it, then
the folder's files by ``report.write_csv`` and ``summary.write``, as ``grade_folder`` calls them.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from PIL import Image

from grading.reports import report, summary
from grading.harness import Graded
from grading.problems import hand_graded

pytestmark = pytest.mark.problem("beyond")

ZERO, PER_PARAMETER = "optimizer_state_sharding", "ddp_overlap_individual_parameters"
FAILURE = "rank 1, step 2: parameter w differs from single-process training by 0.031"


def graded_tests(problem: str, points: int, failed: set[int], n: int = 3) -> list[report.TestGrade]:
    shares = report.shares(points, n)
    return [report.TestGrade(f"test_{problem}.py::test_{i}", problem, 1, 0 if i in failed else 1,
                             FAILURE.replace("0.031", f"0.0{i + 3}") if i in failed else "", shares[i],
                             requirement="handout: it trains") for i in range(n)]


SUBMODULE = ("git submodule not initialised: cs336-basics (upload with submodules). git clone "
             "--recurse-submodules fetches it; cs336_basics is in it.")


def write_grade(out: Path, name: str, edition: str, failed: dict[str, set[int]], repeats: int = 2,
                remarks: tuple[str, ...] = ()) -> Graded:
    problems = {"2025": [PER_PARAMETER, ZERO], "2026": [ZERO]}[edition]
    points = {PER_PARAMETER: 5, ZERO: 15}
    tests = [t for p in problems for t in graded_tests(p, points[p], failed.get(p, set()))]
    rows = report.problem_grades(tests, problems, hand_graded(edition))
    run = report.Run(edition, "abc123def456", repeats)
    report.write_outputs(out / name, name, "header", tests, rows, 12.0, list(remarks), run)
    return Graded(name, rows, tests, 12.0, remarks=remarks)


@pytest.fixture
def folder(tmp_path) -> tuple[Path, list[Graded]]:
    out = tmp_path / "grades"
    graded = [write_grade(out, "alice", "2025", {}),
              write_grade(out, "bob", "2025", {ZERO: {1}, PER_PARAMETER: {0, 2}}),
              write_grade(out, "carol", "2026", {ZERO: {1}}, remarks=(SUBMODULE,)),
              Graded("dan", [], [], 3.0, "not graded: FileExistsError: dan")]
    report.write_csv(out / "grades.csv", [(g.name, g.rows, g.note or summary.short_remarks(g)) for g in graded])
    sources = {g.name: tmp_path / "inbox" / (g.name + ".zip") for g in graded}
    summary.write(out, graded, summary.Batch(2, 185.0, sources, skipped=1))
    return out, graded


def test_summary_has_the_roster_the_run_and_failures_by_test_and_edition(folder):
    out, _ = folder
    text = (out / "summary.md").read_text()
    assert "Grader commit abc123def456; REPEATS=2" in text and "wall time 3 min 5 s" in text
    assert "1 graded by an earlier run and kept" in text
    inbox = out.parent / "inbox"
    assert (f"| alice | 2025 | 20.0 / 20 | [grade.md](alice/grade.md) | `make grade SUBMISSION={inbox}/alice.zip "
            f"OUT={out}/alice EDITION=2025 REPEATS=2` |  |") in text
    assert "| bob | 2025 | 11.7 / 20 |" in text  # 15 - 5 on ZERO, 5 - 1.6667 - 1.6666 on PER_PARAMETER
    assert "| carol | 2026 | 10.0 / 15 |" in text
    assert "| dan |  |  | not graded: FileExistsError: dan |  |  |" in text
    assert text.split("| carol |")[1].splitlines()[0].endswith(
        "| git submodule not initialised: cs336-basics (upload with submodules) |")
    assert "## Edition 2025: 2 submissions" in text and "## Edition 2026: 1 submission\n" in text
    edition_2025 = text.split("## Edition 2025")[1].split("## Edition 2026")[0]
    assert f"| {ZERO} | 15 | 1 | 1 | 0 | 15 |" in edition_2025
    assert f"| {ZERO} | 15 | 0 | 1 | 0 | 10 |" in text.split("## Edition 2026")[1]
    assert f"| `test_{ZERO}.py::test_1` | 2 | bob, carol |" in text
    assert f"| `test_{PER_PARAMETER}.py::test_0` | 1 | bob |" in text
    # one cause (test and finding), counted by students, whatever the rank, step and numbers
    assert f"| 2 | `test_1` | bob: {FAILURE.replace('0.031', '0.04')} |" in text
    assert f"| 1 | `test_0` | bob: {FAILURE.replace('0.031', '0.03')} |" in text


def test_grades_csv_has_an_edition_column(folder):
    out, _ = folder
    rows = list(csv.DictReader((out / "grades.csv").open()))
    assert [(r["submission"], r["edition"], r["total"]) for r in rows] == [
        ("alice", "2025", "20.00"), ("bob", "2025", "11.67"), ("carol", "2026", "10.00"), ("dan", "", "")]
    assert rows[2]["note"] == "git submodule not initialised: cs336-basics (upload with submodules)"
    assert rows[3]["note"] == "not graded: FileExistsError: dan"


def test_causes_group_what_students_did_the_same_way():
    rank_and_file = ["rank 0: cs336_systems/ddp.py:42: NotImplementedError (adapter not implemented)",
                     "rank 1: student/ddp_impl.py:7: NotImplementedError (adapter not implemented) [checks: x]"]
    assert summary.finding(rank_and_file[0]) == summary.finding(rank_and_file[1])
    assert summary.finding("rank 1 died (SIGSEGV)") == "rank N died (SIGSEGV)"
    assert summary.test_function("test_fsdp.py::test_adamw[2-rep1]") == "test_adamw"


def test_a_rerun_keeps_a_submissions_remarks(tmp_path):
    from grading.course.course import _already, _key, _sign

    out = tmp_path / "grades"
    write_grade(out, "erin", "2026", {}, remarks=(SUBMODULE,))
    key = _key(out)
    _sign(key, out / "erin")
    assert summary.short_remarks(_already(out / "erin", key)) == (
        "git submodule not initialised: cs336-basics (upload with submodules)")


def test_figure_has_a_bar_per_score_that_occurs(folder, monkeypatch):
    out, graded = folder
    drawn = {}

    def record(path, scores, possible, editions):
        drawn.update(scores=scores, editions=editions)

    monkeypatch.setattr(summary, "_figure", record)
    summary.write(out, graded)
    assert sorted(drawn["scores"][ZERO]) == [10.0, 10.0, 15.0]
    assert drawn["editions"] == {PER_PARAMETER: ["2025"], ZERO: ["2025", "2026"]}
    with Image.open(out / "summary.png") as image:  # the one the fixture drew
        assert image.size[0] > 400


def test_results_json_tells_the_student_the_score_and_what_is_graded_by_hand(folder):
    out, _ = folder
    results = json.loads((out / "bob" / "results.json").read_text())
    assert results["visibility"] == "visible" and results["stdout_visibility"] == "hidden"
    assert results["output_format"] == "md"
    output = results["output"]
    assert f"| {ZERO} | 2/3 | 10.0 / 15 |" in output and "| **total** | 3/6 | **11.7 / 20** |" in output
    assert "Each test runs 2 times and scores only if every run passes" in output
    assert "Graded by hand from your writeup, not part of this score: distributed_communication_single_node (5" in output
    assert "isolation" not in output and "abc123def456" in output
    assert results["extra_data"]["grader_commit"] == "abc123def456" and results["extra_data"]["repeats"] == 2
    assert results["extra_data"]["torch"].startswith("2.")
