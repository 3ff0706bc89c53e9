"""Grading a whole course: the Gradescope package, a folder through submitit, reruns, the summary.

The autograder zip is unpacked into a scratch root and its ``run_autograder`` run there (with this
environment's Python: its ``setup.sh`` needs PyTorch's CPU index); a folder is graded in process
and through submitit's local executor, and the two ``grades.csv`` must be equal. Each grading
selects a few quick tests (``only``, ``select``) to keep ``make test`` short.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from grading.autograder import build
from grading.course import grade_folder
from grading.harness import grade
from tests.test_grading import QUICK, ZERO, assert_gradescope_schema, make_submission

pytestmark = pytest.mark.problem("beyond")


def test_autograder_zip_has_what_gradescope_runs(tmp_path):
    with zipfile.ZipFile(build(tmp_path / "autograder.zip")) as z:
        names = set(z.namelist())
        assert {"setup.sh", "run_autograder", "requirements.txt", "grading/COMMIT", "grading/harness.py",
                "grading/suite/test_fsdp.py", "grading/problems.toml"} <= names
        for script in ("setup.sh", "run_autograder"):
            assert (z.getinfo(script).external_attr >> 16) & stat.S_IXUSR
        wanted = z.read("requirements.txt").decode().splitlines()
        setup = z.read("setup.sh").decode()
    packages = {line.split("==")[0] for line in wanted}
    assert {"pytest", "numpy", "pandas", "triton"} <= packages
    assert not [p for p in packages if p == "torch" or p.startswith(("nvidia-", "cuda-"))]
    assert "download.pytorch.org/whl/cpu" in setup and '"torch<=2.' in setup


@pytest.mark.parametrize("stub", [False, True], ids=["correct", "stub"])
def test_run_autograder_grades_as_make_grade_does(tmp_path, stub):
    root = tmp_path / "autograder"
    with zipfile.ZipFile(build(tmp_path / "autograder.zip")) as z:
        z.extractall(root / "source")
    os.chmod(root / "source" / "run_autograder", 0o755)
    tree = make_submission(tmp_path, stub=stub)
    shutil.copytree(tree, root / "submission")
    env = {**os.environ, "AUTOGRADER_ROOT": str(root), "GRADING_PYTHON": sys.executable, "REPEATS": "1"}
    subprocess.run([str(root / "source" / "run_autograder")], env=env, check=True, capture_output=True, timeout=300)
    theirs = json.loads((root / "results" / "results.json").read_text())
    assert_gradescope_schema(theirs)
    ours = grade(tree, tmp_path / "ours", 1, quiet=True)
    mine = json.loads((tmp_path / "ours" / "results.json").read_text())
    assert [(t["name"], t["max_score"]) for t in theirs["tests"]] == [(t["name"], t["max_score"]) for t in mine["tests"]]
    assert theirs["score"] == mine["score"] == sum(t.score for t in ours.tests)
    assert (theirs["score"] == 0) == stub
    assert "grader commit" in theirs["output"]


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "inbox"
    folder.mkdir()
    make_submission(folder)
    make_submission(folder, stub=True)
    make_submission(folder, "sums").rename(folder / "dies")
    return folder


def _rows(path: Path) -> list[dict]:
    return list(csv.DictReader(path.open()))


def test_folder_through_submitit_gives_the_in_process_grades_and_a_summary(tmp_path):
    folder = _folder(tmp_path)
    common = dict(repeats=1, edition="2025", limits=QUICK, jobs=2, only=(ZERO,), select="test_sgd_with_momentum",
                  quiet=True)
    outs = {}
    for executor in ("inprocess", "local"):
        out = tmp_path / executor
        (out / "dies").parent.mkdir(parents=True)
        (out / "dies").write_text("a file where the submission's folder must go: its grading dies")
        grade_folder(folder, out, executor=executor, **common)
        outs[executor] = out
    rows = _rows(outs["inprocess"] / "grades.csv")
    assert rows == [{**r, "note": r["note"].replace("/local/", "/inprocess/")} for r in _rows(outs["local"] / "grades.csv")]
    by_name = {r["submission"]: r for r in rows}
    assert (by_name["correct"][ZERO], by_name["stub"][ZERO]) == ("15.00", "0.00")
    assert by_name["dies"][ZERO] == "" and by_name["dies"]["note"].startswith("not graded: ")
    assert "FileExistsError" in by_name["dies"]["note"]
    summary = (outs["local"] / "summary.md").read_text()
    assert f"| {ZERO} | 15 | 1 | 0 | 1 |" in summary
    assert "not graded (their job died): dies" in summary
    assert "NotImplementedError (adapter not implemented)" in summary
    assert (outs["local"] / "summary.png").stat().st_size > 1000


def test_a_rerun_skips_what_was_graded_unless_regrade(tmp_path):
    folder = tmp_path / "inbox"
    folder.mkdir()
    make_submission(folder, stub=True)
    common = dict(repeats=1, edition="2025", limits=QUICK, jobs=1, only=(ZERO,), select="test_sgd_with_momentum",
                  quiet=True)
    first = grade_folder(folder, tmp_path / "out", **common)
    record = tmp_path / "out" / "stub" / "grade.json"
    stamp = record.stat().st_mtime_ns
    again = grade_folder(folder, tmp_path / "out", **common)
    assert record.stat().st_mtime_ns == stamp and again[0].rows == first[0].rows
    grade_folder(folder, tmp_path / "out", regrade=True, **common)
    assert record.stat().st_mtime_ns != stamp


def test_slurm_submits_one_array_on_the_partition(tmp_path, monkeypatch):
    """The SLURM path, on submitit's local executor: one job array (at most JOBS running) on the
    partition asked for, every result gathered."""
    import submitit

    asked: dict = {}

    class Recording(submitit.LocalExecutor):
        def __init__(self, folder, cluster=None):
            asked["cluster"] = cluster
            super().__init__(folder)

        def update_parameters(self, **params):
            asked.update(params)
            super().update_parameters(**{k: v for k, v in params.items() if not k.startswith(("slurm_", "mem_", "cpus_"))})

    monkeypatch.setattr(submitit, "AutoExecutor", Recording)
    folder = tmp_path / "inbox"
    folder.mkdir()
    make_submission(folder, stub=True)
    graded = grade_folder(folder, tmp_path / "out", 1, "2025", QUICK, 3, (ZERO,), "test_sgd_with_momentum",
                          executor="slurm", partition="cpu", quiet=True)
    assert asked["cluster"] == "slurm" and asked["slurm_partition"] == "cpu" and asked["slurm_array_parallelism"] == 3
    assert [(g.name, g.rows[0].points) for g in graded] == [("stub", 0.0)]
