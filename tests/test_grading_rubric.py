"""The rubric (grading/problems.toml): each test's share, the caps, and what a student reads.

A problem's points follow what it is named for. One-edit mutants of the answers
(cs336_systems/answers/ laid out by tests/answers_fixture.py; ANSWER_EDITS there), with bugs in
different problems' files so that one grading run checks three problems at once, must lose
exactly their share: a blocking hook or an all-reduce only after backward
keeps at most a third of the per-parameter DDP's points, an optimizer or an FSDP that shards
nothing at most a third of theirs, wrong group options or a missing ``add_param_group`` the
groups tests, an ignored ``compute_dtype`` the compute-dtype tests. Each failure says what it
found, in the order a TA reads it.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from grading.harness import grade, namespaces_available
from grading.problems import POINTS, RUBRIC, named_for
from grading.reports.report import grade_markdown, grade_tests, problem_grades
from tests.answers_fixture import ANSWER_EDITS, apply_edits
from tests.test_grading import FSDP, PER_PARAMETER, QUICK, ZERO, failures, make_submission, points, unpassed

pytestmark = pytest.mark.problem("beyond")

SUITE = Path(__file__).resolve().parents[1] / "grading" / "suite"
SUITE_FILES = {"ddp_overlap_individual_parameters": "test_ddp_individual_parameters.py",
               "ddp_overlap_bucketed": "test_ddp_bucketed.py", "optimizer_state_sharding": "test_sharded_optimizer.py",
               "fsdp": "test_fsdp.py"}

def edited(tmp_path: Path, *names: str) -> Path:
    """The answers with the edits of ``names`` (ANSWER_EDITS, tests/answers_fixture.py)."""
    tree = make_submission(tmp_path)
    for name in names:
        apply_edits(tree, name, ANSWER_EDITS[name])
    return tree


# the checks beyond the handout score nothing
GRADED_ONLY = "not test_unused_layer and not test_uneven_shards"


def failed(graded, problem: str) -> list[str]:
    return sorted(t.name.split("::")[1] for t in graded.tests if t.problem == problem and not t.passed and not t.beyond)


def test_rubric_covers_every_graded_test_and_sums_to_the_handouts_points():
    """Every graded test function of the suite has a share and every share a test; the point
    tests exist; the shares sum to the handout's points; the cap is a third."""
    for problem, file in SUITE_FILES.items():
        tree = ast.parse((SUITE / file).read_text())
        graded = {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
                  and not any("beyond_handout" in ast.unparse(d) for d in f.decorator_list)}
        rubric = RUBRIC[problem]
        assert set(rubric.shares) == graded, (problem, set(rubric.shares) ^ graded)
        assert set(rubric.point) <= graded and rubric.cap == pytest.approx(1 / 3)
        assert round(sum(rubric.shares.values()), 6) == POINTS[problem][0]
        assert sum(rubric.shares[t] for t in rubric.point) > POINTS[problem][0] / 3  # worth more than the cap


def _entries(problem: str, tests: dict[str, str]) -> list[dict]:
    """Plugin lines for ``tests`` (name -> failure reason, "" for passed)."""
    lines = [{"collected": name, "problem": problem} for name in tests]
    return lines + [{"test": name, "problem": problem, "passed": not why, "reason": why} for name, why in tests.items()]


def test_cap_follows_the_point_test_whatever_its_reason(tmp_path):
    """A sharding test that fails caps the problem at a third, whatever its reason: want of
    sharding, wrong training, or an exception a rank raised there (a rank that recognises the
    point test must not trade the cap for the test's share). grade.md shows the cap and the
    rubric; the passed tests' scores sum to the capped points."""
    base = {f"test_sharded_optimizer.py::{name}": "" for name in (
        "test_matches_single_process[2]", "test_matches_single_process[3]", "test_sgd_with_momentum",
        "test_parameter_groups[2-sgd]", "test_parameter_groups[3-adamw]", "test_add_param_group[2-adamw]",
        "test_add_param_group[3-sgd]", "test_state_is_sharded[2]", "test_state_is_sharded[3]",
        "test_every_rank_keeps_its_share")}
    unsharded = f"rank 1 holds 100% of the unsharded state: not sharded {named_for(ZERO)}"
    for reason in (unsharded, "rank 2: parameter x after step 1 of 3 differs", "rank 2: RuntimeError: x"):
        tests = grade_tests(_entries(ZERO, {**base, "test_sharded_optimizer.py::test_state_is_sharded[3]": reason}), [ZERO])
        (row,) = problem_grades(tests, [ZERO])
        assert row.points == 5.0 and round(sum(t.score for t in tests), 4) == 5.0 and row.capped
    tests = grade_tests(_entries(ZERO, {**base, "test_sharded_optimizer.py::test_sgd_with_momentum": "rank 0: x"}), [ZERO])
    (row,) = problem_grades(tests, [ZERO])
    assert row.points == 14.0 and not row.capped  # a test of something else costs its share alone
    text = grade_markdown("x", "header", [row], tests)
    assert "**Capped:**" not in text and "## Rubric (grading/problems.toml)" in text
    capped = grade_tests(_entries(ZERO, {**base, "test_sharded_optimizer.py::test_state_is_sharded[2]": unsharded}), [ZERO])
    text = grade_markdown("x", "header", problem_grades(capped, [ZERO]), capped)
    assert f"**Capped:** {ZERO} is capped at 1/3 of its points (5 of 15): test_state_is_sharded[2], a test of" in text
    assert "test_state_is_sharded 6, test_every_rank_keeps_its_share 2 (a test run at several parameters" in text
    assert "scores 0.4167 of 1:" in next(t.output for t in capped if t.name.endswith("test_parameter_groups[2-sgd]"))


def test_one_bug_per_problem_loses_exactly_its_share(tmp_path):
    """A blocking all-reduce in each hook (capped: 5/3 of 5); group options dropped and
    add_param_group assigned at construction only (the groups tests and the add_param_group
    tests, 2 + 2 of 15); compute_dtype ignored (the two compute-dtype tests, and in namespace mode the
    traffic test's bfloat16 run: the weights are gathered in float32)."""
    tree = edited(tmp_path, "blocking_hook", "wrong_group_options", "no_add_param_group", "ignores_compute_dtype")
    graded = grade(tree, tmp_path / "out", 1, "2026", QUICK, quiet=True, select=GRADED_ONLY)
    # in namespace mode the traffic test's bfloat16 run fails too: the weights gathered in float32
    traffic = ["test_gradients_are_reduce_scattered[2-bfloat16]"] if namespaces_available() else []
    lost_fsdp = sum(t.max_score for t in graded.tests if t.problem == FSDP and not t.passed and not t.beyond)
    assert [points(graded, p) for p in (PER_PARAMETER, ZERO, FSDP)] == [round(5 / 3, 4), 11.0, round(15 - lost_fsdp, 4)], \
        unpassed(graded)
    assert failed(graded, PER_PARAMETER) == ["test_communicates_during_backward[get_ddp]"]
    assert "blocked it (async_op=False, or waited on while layers still computed" in failures(graded, PER_PARAMETER)[0]
    assert failed(graded, ZERO) == ["test_add_param_group[2-adamw]", "test_add_param_group[3-sgd]",
                                    "test_parameter_groups[2-sgd]", "test_parameter_groups[3-adamw]"]
    added = [t.output for t in graded.tests if "test_add_param_group" in t.name]
    assert all("after step 2 of 3 differs from single-process training" in line for line in added), added
    assert failed(graded, FSDP) == ["test_compute_dtype[bfloat16]", "test_compute_dtype[float16]", *traffic]
    assert all(t.output.startswith("rank 0: the model's output is torch.float32 with compute_dtype=torch.")
               for t in graded.tests if "test_compute_dtype" in t.name), failures(graded, FSDP)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert round(sum(t["score"] for t in results["tests"]), 4) == pytest.approx(results["score"])
    assert "**Capped:** ddp_overlap_individual_parameters is capped at 1/3" in (tmp_path / "out" / "grade.md").read_text()


def test_what_a_problem_is_named_for_is_never_hidden(tmp_path):
    """Gradients never averaged: the ranks' disagreement is said first. An optimizer that shards
    nothing but trains right: 5 of 15. An FSDP that keeps full weights and sums gradients: both
    findings, the sharding one first."""
    tree = edited(tmp_path, "skips_averaging", "no_state_sharding", "full_weights_and_sums")
    graded = grade(tree, tmp_path / "out", 1, "2026", QUICK, quiet=True, select=GRADED_ONLY)
    assert [points(graded, p) for p in (PER_PARAMETER, ZERO, FSDP)] == [0.0, 5.0, 0.0]
    matches = next(t.output for t in graded.tests if "test_matches_single_process" in t.name and t.problem == PER_PARAMETER)
    assert matches.startswith("rank 0 and rank 1 hold different weights after step 1 of 3: gradients are not averaged "
                              "over ranks"), matches
    assert failed(graded, ZERO) == ["test_state_is_sharded[2]", "test_state_is_sharded[3]"]
    assert all(f"not sharded {named_for(ZERO)}" in line for line in failures(graded, ZERO))
    sharded = [t.output for t in graded.tests if "test_parameters_are_sharded" in t.name]
    assert len(sharded) == 2 and all(line.startswith("rank 0 holds") and f"not sharded {named_for(FSDP)}" in line
                                     and "; also: rank" in line for line in sharded), sharded
