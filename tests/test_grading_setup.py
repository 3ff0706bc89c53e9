"""The grader wherever it is installed: a set-up that cannot start ranks grades nothing.

A grader whose ranks cannot start (a memory limit below torch's, an interpreter the ranks'
view hides) would fail every test of every submission the same way; it must stop before the
first submission, in one line, and write no grade (grading/selfcheck.py). And the layouts
users make (a ``.venv`` that links to another environment, packages on ``PYTHONPATH``,
site-packages entries that are links) must give the ranks what they import
(containment.python_folders).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from grading.isolation import containment
from grading.harness import GRADER_DIR, Limits, grade
from grading.selfcheck import SetupError
from tests.test_grading import make_submission

pytestmark = pytest.mark.problem("beyond")

REPO = GRADER_DIR.parent
QUICK = ("ddp_overlap_individual_parameters", "test_matches_single_process")


def test_a_memory_limit_below_torchs_grades_nothing(tmp_path):
    """Ranks that cannot import torch under the limit: SetupError in one line, no results.json,
    and ``python -m grading`` exits 3 saying why."""
    with pytest.raises(SetupError, match="graded nothing: .*ImportError"):
        grade(make_submission(tmp_path), tmp_path / "out", 1, "2025", Limits(memory_gb=0.3), quiet=True)
    assert not (tmp_path / "out" / "results.json").exists()
    done = subprocess.run([sys.executable, "-m", "grading", str(tmp_path / "correct"), "--out", str(tmp_path / "cli"),
                           "--repeats", "1", "--memory-gb", "0.3"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "graded nothing" in done.stderr
    assert not (tmp_path / "cli" / "results.json").exists()


def test_python_folders_follow_pythonpath_and_links(tmp_path, monkeypatch):
    """A package folder on the path and where linked site-packages entries lead are kept in the
    ranks' view; the grader's checkout and folders holding a course package are not."""
    carried, elsewhere, course = tmp_path / "site", tmp_path / "other-env", tmp_path / "course"
    for folder in (carried, elsewhere / "torchlike", course / "cs336_systems"):
        folder.mkdir(parents=True)
    packages = tmp_path / "venv-site"
    packages.mkdir()
    (packages / "torchlike").symlink_to(elsewhere / "torchlike")
    monkeypatch.setattr(sys, "path", [*sys.path, str(carried), str(course), str(REPO), str(REPO / "tests")])
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(packages)])
    assert containment.package_paths() == [str(carried.resolve())]
    folders = containment.python_folders()
    assert str(elsewhere.resolve()) in folders and str(carried.resolve()) in folders
    assert not any(f == str(REPO) or f.startswith(str(course)) for f in folders)


def test_a_checkout_whose_venv_links_elsewhere_grades_fully(tmp_path):
    """A copy of the grader whose ``.venv`` is a link to this environment (a second checkout
    sharing the first one's packages): the probe passes, and the answers get that test's points."""
    tree = make_submission(tmp_path)
    checkout = tmp_path / "second checkout"  # a space in the path too
    shutil.copytree(GRADER_DIR, checkout / "grading", ignore=shutil.ignore_patterns("__pycache__"))
    (checkout / ".venv").symlink_to(Path(sys.prefix))
    python = checkout / ".venv" / "bin" / Path(sys.executable).name
    script = ("import json, sys\nfrom pathlib import Path\nfrom grading.harness import grade\n"
              f"g = grade(Path({str(tree)!r}), Path({str(tmp_path / 'out')!r}), 1, '2025', quiet=True, "
              f"only=({QUICK[0]!r},), select={QUICK[1]!r})\n"
              "print(json.dumps([(t.name, t.passed, t.reason) for t in g.tests]))")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(checkout)}
    done = subprocess.run([str(python), "-c", script], cwd=checkout, capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    tests = json.loads(done.stdout.strip().splitlines()[-1])
    assert tests and all(passed for _, passed, _ in tests), tests


def test_adapters_in_a_tests_folder_without_init_load(tmp_path):
    """A submission whose ``tests/`` has no ``__init__.py`` (Python imports it as a namespace
    package) gets its adapters loaded, not a grader error."""
    tree = make_submission(tmp_path)
    (tree / "tests" / "__init__.py").unlink()
    graded = grade(tree, tmp_path / "out", 1, "2025", quiet=True, only=(QUICK[0],), select=QUICK[1])
    assert graded.tests and all(t.passed for t in graded.tests), [(t.name, t.reason) for t in graded.tests]
