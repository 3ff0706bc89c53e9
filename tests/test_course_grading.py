"""Grading a whole course: the Gradescope package, a folder through submitit, reruns, the summary.

The autograder zip is laid out in a scratch root as Gradescope lays it out, and the copy of
``run_autograder`` at that root is started from it with an interpreter that has the locked
packages but no path to this repository (``setup.sh`` itself needs PyTorch's CPU index); a folder is graded in process
and through submitit's local executor, and the two ``grades.csv`` must be equal. Each grading
selects a few quick tests (``only``, ``select``) to keep ``make test`` short.
"""

from __future__ import annotations

import csv
import importlib.metadata
import json
import os
import shutil
import stat
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

from grading.course.autograder import ROOT, build
from grading.course.course import grade_folder
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
    locked = next(p for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"] if p["name"] == "torch")["version"]
    assert "download.pytorch.org/whl/cpu" in setup and f'"torch=={locked}"' in setup


def gradescope_root(tmp_path: Path) -> Path:
    """A scratch ``/autograder`` as Gradescope lays it out once ``setup.sh`` has run: the zip in
    ``source/``, ``run_autograder`` copied to the root, and ``venv/`` with the locked packages but
    no path to this repository (``setup.sh`` itself needs PyTorch's CPU index): a venv of the base
    interpreter whose site-packages links every entry of this environment's, but the editable
    install of this project (its ``.pth`` and metadata)."""
    root = tmp_path / "autograder"
    with zipfile.ZipFile(build(tmp_path / "autograder.zip")) as z:
        z.extractall(root / "source")
    for script in ("setup.sh", "run_autograder"):
        os.chmod(root / "source" / script, 0o755)
    shutil.copy2(root / "source" / "run_autograder", root / "run_autograder")
    venv.create(root / "venv", with_pip=False, symlinks=True)
    python = root / "venv" / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                               text=True, check=True).stdout.strip())
    locked = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "torch").is_dir())
    project = ("cs336_systems", "_cs336_systems", "__editable__")
    for entry in locked.iterdir():
        if not entry.name.startswith(project) and entry.name != "__pycache__":
            (site / entry.name).symlink_to(entry)
    probe = subprocess.run([python, "-c", "import torch, pytest\nfor name in ('grading', 'cs336_systems', 'cs336_basics'):\n"
                            "    try:\n        __import__(name)\n    except ImportError:\n        continue\n"
                            "    raise SystemExit(name + ' is importable')"],
                           cwd=root, capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert probe.returncode == 0, probe.stderr or probe.stdout
    return root


def run_autograder(root: Path, submission: Path, **env: str) -> dict:
    """Gradescope's run: the submission in ROOT/submission, ROOT/run_autograder started from ROOT."""
    shutil.rmtree(root / "submission", ignore_errors=True)
    shutil.rmtree(root / "results", ignore_errors=True)
    shutil.copytree(submission, root / "submission")
    done = subprocess.run(["./run_autograder"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PATH": os.environ["PATH"], "HOME": str(root), **env})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((root / "results" / "results.json").read_text())


def test_run_autograder_grades_in_gradescopes_layout_as_make_grade_does(tmp_path):
    """The answers get every point and the stub none, with the tests and points that
    ``grade()`` (``make grade``) gives the same trees; results.json names the grader's commit
    and torch's version."""
    root = gradescope_root(tmp_path)
    stub = make_submission(tmp_path, stub=True)
    ours = grade(stub, tmp_path / "ours", 1, quiet=True)
    mine = json.loads((tmp_path / "ours" / "results.json").read_text())
    for tree, full in ((make_submission(tmp_path), True), (stub, False)):
        theirs = run_autograder(root, tree, REPEATS="1")
        assert_gradescope_schema(theirs)
        assert [(t["name"], t["max_score"]) for t in theirs["tests"]] == [(t["name"], t["max_score"]) for t in mine["tests"]]
        possible = sum(t["max_score"] for t in theirs["tests"])
        if full:
            # the tests worth points; one beyond the handout (0 points) fails on the answers: they refuse
            # dimensions the world size does not divide (test_uneven_shards)
            failed = [(t["name"], t["output"]) for t in theirs["tests"] if t["status"] != "passed" and t["max_score"] > 0]
            assert theirs["score"] == pytest.approx(possible) and not failed, failed
        else:
            assert theirs["score"] == mine["score"] == sum(t.score for t in ours.tests) == 0
        assert theirs["extra_data"]["torch"] == importlib.metadata.version("torch")
        assert theirs["extra_data"]["grader_commit"] == (root / "source" / "grading" / "COMMIT").read_text().strip()


def test_setup_stops_with_one_line_when_the_index_cannot_be_reached(tmp_path):
    root = tmp_path / "autograder"
    with zipfile.ZipFile(build(tmp_path / "autograder.zip")) as z:
        z.extractall(root / "source")
    done = subprocess.run(["bash", "setup.sh"], cwd=root / "source", capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "TORCH_INDEX_URL": "http://127.0.0.1:9/whl/cpu"})
    assert done.returncode == 1 and not (root / "venv").exists()
    assert done.stderr.strip().splitlines() == [
        "setup.sh: PyTorch's CPU index http://127.0.0.1:9/whl/cpu/torch/ cannot be reached (no network while the "
        "image builds?); set TORCH_INDEX_URL to a mirror"]


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
