"""The grader judged by what it fails: graded submissions and the scores they must get.

The correct submission is the answers (cs336_systems/answers/), laid out as a student hands them
in by ``tests/answers_fixture.py``: 35/35 for 2026, 28/28 for 2025. Each wrong submission is that
tree with one edit (a mutant, ``ANSWER_MUTANTS`` there): sums instead of averages, a deadlock, a
syntax error, an import error, the public stub, and the shortcuts the public tests let through (no
overlap, the bucket size ignored, the full optimizer state or full weights on every rank, weights
rebuilt from a seed, gathered weights kept from forward to backward). Every mutant must lose
exactly the problem it breaks, with a one-line reason, and leave the others' points alone; the
equivalent variants (more padding per shard) must lose nothing. Grading runs with one repetition
and only the problems and tests a case needs (``only``, and ``select``, a pytest ``-k``
expression), to keep ``make test`` quick."""

from __future__ import annotations

import csv
import json
import os
import random
import shutil
import time
import zipfile
from pathlib import Path

import pytest

from grading.course.course import grade_folder
from grading.harness import Limits, grade
from grading.problems import POINTS, RUBRIC
from grading.reports.report import shares
from tests.answers_fixture import apply_mutant, build_answers_submission

pytestmark = pytest.mark.problem("beyond")

PER_PARAMETER, BUCKETED = "ddp_overlap_individual_parameters", "ddp_overlap_bucketed"
ZERO, FSDP = "optimizer_state_sharding", "fsdp"
QUICK = Limits(test_timeout_s=60, submission_timeout_s=600)


def make_submission(tmp_path: Path, mutant: str | None = None, stub: bool = False) -> Path:
    """The answers as a submission (tests/answers_fixture.py) with ``mutant``'s edits (several
    mutants joined by "+"), or with the public stub's adapters."""
    tree = build_answers_submission(tmp_path / (mutant or ("stub" if stub else "correct")))
    for name in mutant.split("+") if mutant else ():
        apply_mutant(tree, name)
    if stub:  # the public stub: every adapter declared, none implemented
        names = [line.split("(")[0].removeprefix("def ") for line in (tree / "tests/adapters.py").read_text().splitlines()
                 if line.startswith("def ")]
        (tree / "tests/adapters.py").write_text("\n\n".join(
            f"def {name}(*args, **kwargs):\n    raise NotImplementedError" for name in names) + "\n")
    return tree


def points(graded, problem: str) -> float:
    return next(r.points for r in graded.rows if r.problem == problem)


def failures(graded, problem: str) -> list[str]:
    return [t.output for t in graded.tests if t.problem == problem and not t.passed]


def unpassed(graded) -> str:
    """Every test that did not pass, its name and whole reason, one per line: an assertion's
    message (pytest shortens a list's repr, not a string)."""
    return "\n".join(f"{t.name}: {t.output}" for t in graded.tests if not t.passed)


def test_correct_submission_gets_every_point(tmp_path):
    graded = grade(make_submission(tmp_path), tmp_path / "out", 1, "2025", QUICK, quiet=True)
    assert [(r.problem, r.points) for r in graded.rows if r.points is not None] == [
        (PER_PARAMETER, 5.0), (BUCKETED, 8.0), (ZERO, 15.0)], unpassed(graded)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert_gradescope_schema(results)
    assert results["score"] == pytest.approx(28.0)
    by_tag: dict[str, float] = {}
    for test in results["tests"]:
        by_tag[test["tags"][0]] = by_tag.get(test["tags"][0], 0) + test["max_score"]
    assert {tag: round(total, 4) for tag, total in by_tag.items()} == {PER_PARAMETER: 5, BUCKETED: 8, ZERO: 15}
    grade_md = (tmp_path / "out" / "grade.md").read_text()
    assert "| communication_accounting |  |  |  | graded by hand (of 10) |" in grade_md
    assert "## Beyond the handout (reported, 0 points)" in grade_md and "test_unused_layer" in grade_md
    assert "**28.0 / 28**" in grade_md


def test_correct_fsdp_gets_every_point(tmp_path):
    graded = grade(make_submission(tmp_path), tmp_path / "out", 1, "2026", QUICK, quiet=True, only=(FSDP,))
    assert points(graded, FSDP) == 15.0, failures(graded, FSDP)


def assert_gradescope_schema(results: dict) -> None:
    assert set(results) >= {"score", "execution_time", "tests"}
    assert isinstance(results["score"], float) and results["execution_time"] >= 0
    for test in results["tests"]:
        assert set(test) == {"name", "score", "max_score", "status", "output", "tags"}
        assert test["status"] in ("passed", "failed") and isinstance(test["output"], str)
        assert 0 <= test["score"] <= test["max_score"] and test["tags"][0] in POINTS
        assert test["max_score"] > 0 or "beyond the handout" in test["name"]


MATCHES = "test_matches_single_process"


@pytest.mark.parametrize("mutant, broken, kept, select, reason", [
    ("sums", (PER_PARAMETER,), (ZERO,), MATCHES, "differs from single-process training"),
    ("syntax", (PER_PARAMETER,), (BUCKETED, ZERO), MATCHES,
     "cs336_systems/answers/ddp_overlap_individual_parameters.py:10: SyntaxError: invalid syntax"),
    ("import_error", (ZERO,), (PER_PARAMETER,), "test_adamw or test_state_is_sharded",
     "cs336_systems/answers/sharded_optimizer.py:13: ModuleNotFoundError: No module named 'cs336_systems.helpers'"),
    ("no_overlap", (PER_PARAMETER,), (), "test_communicates_during_backward",
     "no all-reduce was issued while backward ran"),
    ("ignores_bucket_size", (BUCKETED,), (), "test_all_reduces_follow_bucket_size",
     "per step (steps 2 and 3, rank 0) for 10 gradients"),
    ("full_optimizer_state", (ZERO,), (), "test_state_is_sharded", "the optimizer state is not sharded"),
    ("reseeds", (PER_PARAMETER,), (), MATCHES, "after construction (every rank must start from rank 0's weights)"),
])
def test_wrong_submission_loses_what_it_breaks(tmp_path, mutant, broken, kept, select, reason):
    graded = grade(make_submission(tmp_path, mutant), tmp_path / "out", 1, "2025", QUICK, quiet=True,
                   only=broken + kept, select=select)
    for problem in broken:
        assert points(graded, problem) < POINTS[problem][0], f"{mutant} kept all of {problem}"
        assert any(reason in line for line in failures(graded, problem)), failures(graded, problem)
        assert all("\n" not in line and "Traceback" not in line for line in failures(graded, problem))
    for problem in kept:
        assert points(graded, problem) == POINTS[problem][0], failures(graded, problem)


def test_partial_credit_is_per_test(tmp_path):
    """Only the overlap test catches a DDP that communicates after backward: 4 of the 5 graded
    tests pass (the unused-layer test is beyond the handout and worth nothing either way), and
    the rubric caps what they earn at a third of the problem's points (problems.toml)."""
    graded = grade(make_submission(tmp_path, "no_overlap"), tmp_path / "out", 1, "2026", QUICK, quiet=True,
                   only=(PER_PARAMETER,))
    assert points(graded, PER_PARAMETER) == round(5 / 3, 4)
    assert [t.requirement.split(":")[0] for t in graded.tests if not t.passed] == ["handout"]


def test_a_bug_at_world_size_three_caps_the_problem(tmp_path):
    """A sharded optimizer that broadcasts from ranks 0 and 1 only is right at 2 ranks, wrong at 3:
    it fails the world-size-3 tests, the sharding tests at 3 ranks among them (for their training
    only: its state is sharded), and a point test that fails for any reason caps the problem."""
    graded = grade(make_submission(tmp_path, "two_ranks_only"), tmp_path / "out", 1, "2025", QUICK, quiet=True,
                   only=(ZERO,))
    assert points(graded, ZERO) == 5.0
    assert sorted(t.name for t in graded.tests if not t.passed) == [
        "test_sharded_optimizer.py::test_add_param_group[3-sgd]", "test_sharded_optimizer.py::test_every_rank_keeps_its_share",
        "test_sharded_optimizer.py::test_matches_single_process[3]", "test_sharded_optimizer.py::test_parameter_groups[3-adamw]",
        "test_sharded_optimizer.py::test_state_is_sharded[3]"]
    assert all(line.startswith("rank ") and "after step 1 of 3 differs from single-process training" in line
               and "(tolerance" in line for line in failures(graded, ZERO)), failures(graded, ZERO)


def test_sharding_checks_fail_what_skips_them(tmp_path):
    """Each sharding check fails the mutant of the answers that skips what it checks, saying why: an
    optimizer partition written for 2 ranks (rank 2 keeps no state at 3 ranks: only the check of
    every rank's share finds it) and an FSDP that leaves the Embedding unsharded (found weight by
    weight at 2 and 3 ranks). Each problem is capped; training is right in both."""
    graded = grade(make_submission(tmp_path, "two_ranks_partition+embedding_unsharded"), tmp_path / "out", 1, "2026",
                   QUICK, quiet=True, only=(ZERO, FSDP),
                   select="test_matches_single_process or test_state_is_sharded or test_every_rank_keeps_its_share "
                          "or test_parameters_are_sharded")
    assert [t.name for t in graded.tests if not t.passed and not t.beyond] == [
        "test_sharded_optimizer.py::test_every_rank_keeps_its_share",
        "test_fsdp.py::test_parameters_are_sharded[2]", "test_fsdp.py::test_parameters_are_sharded[3]"], failures(graded, FSDP)
    (share,) = failures(graded, ZERO)
    assert share.startswith("rank 2 holds at most") and "this rank was given no share of the parameters" in share
    assert all(line.startswith("rank 0 holds") and "weights are not sharded" in line and "[hint, counted inside the rank: "
               "largest fsdp.module.embedding.weight" in line for line in failures(graded, FSDP)), failures(graded, FSDP)
    assert points(graded, ZERO) == 5.0 and points(graded, FSDP) <= 5.0  # at most the cap (FSDP earns less anyway)


def test_equivalent_fsdp_variant_passes_the_memory_checks(tmp_path):
    """Flat shards with 100 elements of padding each (the answers free the gathered weights after
    forward and gather them again in backward already): every measured check passes, the
    gathered-weights one (graded) included."""
    graded = grade(make_submission(tmp_path, "padded_shards"), tmp_path / "out", 1, "2026", QUICK, quiet=True,
                   only=(FSDP,), select="test_matches_single_process or test_parameters_are_sharded or test_gathered")
    assert not unpassed(graded), unpassed(graded)
    assert any(not t.beyond and t.max_score > 0 and t.name.endswith("test_gathered_weights_are_freed") for t in graded.tests)


def test_fsdp_keeping_gathered_weights_loses_their_share(tmp_path):
    """The answers with the gathered weights kept from forward to backward (autograd saved them;
    backward does not gather again): the gathered-weights check fails with the handout's words and
    costs its share (15/8 of 15); sharding between steps and training are right, so nothing else is lost."""
    graded = grade(make_submission(tmp_path, "keeps_gathered"), tmp_path / "out", 1, "2026", QUICK, quiet=True,
                   only=(FSDP,), select="test_matches_single_process or test_parameters_are_sharded or test_gathered")
    assert [t.name for t in graded.tests if not t.passed] == ["test_fsdp.py::test_gathered_weights_are_freed"]
    (line,) = failures(graded, FSDP)
    assert line.startswith('the gathered weights are not freed after use (handout: "Make sure to free the gathered '
                           'weights after use"'), line
    assert "more between forward and backward" in line and "gathered weights of" in line, line
    shares = RUBRIC[FSDP].shares  # of the tests selected: the gathered-weights one is lost, nothing else
    chosen = [shares[t] for t in ("test_matches_single_process", "test_parameters_are_sharded", "test_gathered_weights_are_freed")]
    assert points(graded, FSDP) == pytest.approx(15 * (1 - chosen[2] / sum(chosen)), abs=2e-4)


def test_checks_beyond_the_handout_cost_nothing(tmp_path):
    """The answers' FSDP refuses dimensions that do not divide the world size, with a clear error,
    and gets every point: uneven shards are beyond the handout, reported in grade.md for 0."""
    graded = grade(make_submission(tmp_path, "refuses_uneven"), tmp_path / "out", 1, "2026", QUICK, quiet=True,
                   only=(FSDP,))
    assert points(graded, FSDP) == 15.0, failures(graded, FSDP)
    (beyond,) = [t for t in graded.tests if t.beyond and "test_uneven_shards" in t.name]
    assert not beyond.passed and "37 rows does not divide 3 ranks evenly" in beyond.output and beyond.max_score == 0
    assert "- `test_fsdp.py::test_uneven_shards`: rank" in (tmp_path / "out" / "grade.md").read_text()


def test_fsdp_keeping_full_weights_loses_fsdp(tmp_path):
    graded = grade(make_submission(tmp_path, "full_weights"), tmp_path / "out", 1, "2026", QUICK, quiet=True,
                   only=(FSDP,), select="test_parameters_are_sharded")
    assert points(graded, FSDP) < 15
    assert any("MB between steps" in line and "weights are not sharded" in line and "full_copy → tensor"
               in line for line in failures(graded, FSDP)), failures(graded, FSDP)


def test_deadlock_times_out_once_and_grading_goes_on(tmp_path):
    """The first hanging test at a world size costs one timeout; the problem's other tests at that
    world size fail at once with its reason; the next problem is graded in full."""
    limits = Limits(test_timeout_s=8, submission_timeout_s=300)
    start = time.monotonic()
    graded = grade(make_submission(tmp_path, "deadlock"), tmp_path / "out", 1, "2025", limits, quiet=True,
                   only=(PER_PARAMETER, ZERO), select=f"{MATCHES} or test_three_ranks or test_adamw")
    assert time.monotonic() - start < 8 * 3 + 60
    assert points(graded, PER_PARAMETER) == 0
    lines = failures(graded, PER_PARAMETER)
    assert sum("timed out after 8 s" in line for line in lines) == 2, lines  # world sizes 2 and 3
    assert any("not run: test_matches_single_process timed out at world size 2" in line for line in lines), lines
    assert all("timed out" in line for line in lines), lines
    assert points(graded, ZERO) == 15
    assert len([t for t in graded.tests if t.problem == ZERO]) == 2  # graded after the hang


def test_stub_scores_zero_with_the_adapter_named(tmp_path):
    graded = grade(make_submission(tmp_path, stub=True), tmp_path / "out", 1, None, QUICK, quiet=True,
                   only=(PER_PARAMETER, ZERO), select=MATCHES)
    assert graded.rows and all(r.points == 0 for r in graded.rows if r.points is not None)
    lines = failures(graded, ZERO)
    assert all(line.startswith("rank ") and "tests/adapters.py:" in line and "NotImplementedError" in line
               for line in lines), lines


def test_missing_adapters_file_scores_zero_without_running(tmp_path):
    tree = make_submission(tmp_path)
    (tree / "tests" / "adapters.py").unlink()
    (tree / "cs336_systems" / "answers" / "adapters.py").unlink()  # or the search for an adapters file finds it
    graded = grade(tree, tmp_path / "out", 1, "2025", QUICK, quiet=True)
    assert all(r.points == 0 for r in graded.rows if r.points is not None)
    assert all("no adapters file" in t.output for t in graded.tests)


def test_double_forked_sleeper_is_gone_after_grading(tmp_path):
    marker = f"{random.randint(10**6, 10**7)}.{os.getpid()}"
    tree = make_submission(tmp_path)
    path = tree / "cs336_systems" / "answers" / "sharded_optimizer.py"
    path.write_text(path.read_text() + (
        "\nimport os as _os\n"
        "if _os.fork() == 0:\n"
        "    _os.setsid()\n"
        "    if _os.fork() == 0:\n"
        f"        _os.execvp('sleep', ['sleep', '{marker}'])\n"
        "    _os._exit(0)\n"))
    grade(tree, tmp_path / "out", 1, "2025", QUICK, quiet=True, only=(ZERO,), select="test_sgd_with_momentum")
    time.sleep(0.5)
    left = [pid for pid in filter(str.isdigit, os.listdir("/proc")) if marker in _cmdline(pid)]
    assert not left, f"processes left behind: {left}"


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_folder_of_checkouts_and_zips_gives_one_csv_row_each(tmp_path):
    folder = tmp_path / "inbox"
    folder.mkdir()
    make_submission(folder, "syntax")
    stub = make_submission(tmp_path, stub=True)
    with zipfile.ZipFile(folder / "stub.zip", "w") as z:  # wrapped in one folder, as zips often are
        for file in stub.rglob("*"):
            z.write(file, Path("student-stub") / file.relative_to(stub))
        z.writestr("../escape.txt", "a path outside the scratch copy is never written")
    graded = grade_folder(folder, tmp_path / "grades", 1, "2025", QUICK, jobs=2, only=(ZERO,),
                          select="test_sgd_with_momentum")
    rows = list(csv.DictReader((tmp_path / "grades" / "grades.csv").open()))
    assert [(r["submission"], float(r[ZERO])) for r in rows] == [("stub", 0.0), ("syntax", 15.0)]
    assert {g.name for g in graded} == {"stub", "syntax"}
    assert (tmp_path / "grades" / "stub" / "results.json").is_file()
    assert not (tmp_path / "escape.txt").exists()


def test_a_test_scores_only_if_every_repetition_passes():
    """Points from the plugin's JSON lines: all runs pass -> full share; some -> flaky, 0; a test
    collected but never run (the time limit) -> 0 with the reason given."""
    from grading.reports.report import grade_tests, problem_grades

    entries = [{"collected": f"t{i}", "problem": ZERO} for i in range(4)]
    entries += [{"test": "t0", "problem": ZERO, "passed": True, "reason": ""}] * 3
    entries += [{"test": "t1", "problem": ZERO, "passed": ok, "reason": "" if ok else "rank 1: boom"}
                for ok in (True, False, True)]
    entries += [{"test": "t2", "problem": ZERO, "passed": False, "reason": "rank 0: wrong"}] * 3
    tests = grade_tests(entries, [ZERO], not_run="not run: time limit")
    outputs = {t.name: (t.score, t.output) for t in tests}
    assert outputs == {"t0": (3.75, "passed 3/3 runs"), "t1": (0.0, "flaky: passed 2/3 runs; failure: rank 1: boom"),
                       "t2": (0.0, "rank 0: wrong"), "t3": (0.0, "not run: time limit")}
    (row,) = [r for r in problem_grades(tests, [ZERO]) if r.points is not None]
    assert (row.passed, row.total, row.flaky, row.points) == (1, 4, 1, 3.75)


def test_submission_never_imports_this_repository(tmp_path):
    """This repository (installed in the grader's environment) has a cs336_basics; a submission
    without one must fail for want of it, not be graded with ours."""
    tree = make_submission(tmp_path)
    shutil.rmtree(tree / "cs336-basics")
    graded = grade(tree, tmp_path / "out", 1, "2026", QUICK, quiet=True, only=(FSDP,), select="test_adamw")
    assert points(graded, FSDP) == 0
    assert all("No module named 'cs336_basics'" in line for line in failures(graded, FSDP)), failures(graded, FSDP)
    top = (tmp_path / "out" / "grade.md").read_text().splitlines()[4]
    assert top.startswith("**Package cs336_basics is not in the submission; looked in cs336-basics/ (absent), the root")


def test_packages_are_found_where_the_projects_pyproject_says(tmp_path):
    """cs336_basics kept in a folder that pyproject.toml's [tool.uv.sources] names, as uv finds it,
    and cs336_systems in a src/ layout beside the root's tests/adapters.py."""
    tree = make_submission(tmp_path)
    (tree / "cs336-basics").rename(tree / "basics_mine")
    (tree / "src").mkdir()
    (tree / "cs336_systems").rename(tree / "src" / "cs336_systems")
    (tree / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.uv.sources]\n'
                                         'cs336-basics = { path = "./basics_mine", editable = true }\n')
    graded = grade(tree, tmp_path / "out", 1, "2026", QUICK, quiet=True, only=(FSDP,), select="test_adamw")
    assert points(graded, FSDP) == 15.0, failures(graded, FSDP)


def test_repetitions_collapse_into_one_test_wherever_pytest_puts_them():
    from grading.reports.plugin import test_name

    assert test_name("grading/suite/t.py::f[rep1]") == "t.py::f"
    assert test_name("grading/suite/t.py::f[2-rep3]") == "t.py::f[2]"
    assert test_name("grading/suite/t.py::f[rep2-get_ddp]") == "t.py::f[get_ddp]"  # a fixture's param after it


def test_shares_sum_to_the_handout_points_exactly():
    for points_ in (5, 8, 15):
        for tests in range(1, 14):
            split = shares(points_, tests)
            assert round(sum(split), 4) == points_ and round(max(split) - min(split), 6) <= 1e-4
