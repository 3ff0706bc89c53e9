"""Hostile submissions (tests/hostile.py) graded as a course would grade them, both ways a grader
runs as root: with namespaces, and without (Gradescope's containers; tests/fallback_grade.py),
alone and in a folder between two correct victims graded two at a time. Each must get what its
code deserves, the victims every point (also on a rerun that trusts earlier grades), no run its
time limit, and nothing outside the scratch copies may change: the folder of submissions, a
canary file, ``/dev``, what a student uid left in ``/tmp``, a process left running.

The whole matrix (every attack, both ways, alone and in a folder) runs with ``FORGERIES=all``;
``make test`` runs a representative part of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import pytest

from grading.isolation import student
from grading.isolation.containment import namespaces_available
from grading.course.course import grade_folder, output_names
from grading.harness import Limits, grade
from grading.intake.submission import python_roots
from tests.hostile import build, hostile
from tests.test_grading import ZERO

pytestmark = pytest.mark.problem("beyond")

LIMITS = Limits(test_timeout_s=60, submission_timeout_s=240)
SELECT = "test_sgd_with_momentum"
KINDS = ("forkserver", "others", "daemon", "discovery", "host", "links", "all")
MODES = ("namespaces", "fallback")
REASON = {"forkserver": "NotImplementedError", "others": "others: wrote nothing", "daemon": "NotImplementedError",
          "host": "host: managed nothing", "discovery": "", "links": "", "all": "host: managed nothing"}
DEFAULT = {("all", "fallback", "alone")}
CASES = [(k, m, w) for k in KINDS for m in MODES for w in ("alone", "folder")
         if os.environ.get("FORGERIES") == "all" or (k, m, w) in DEFAULT]
FORGERY = "m_forgery"  # graded between a_victim and z_victim
REPO = Path(__file__).resolve().parent.parent


def summary(graded) -> dict:
    return {"points": {r.problem: r.points for r in graded.rows if r.points is not None},
            "runs": [t.runs for t in graded.tests], "outputs": [t.output for t in graded.tests],
            "seconds": graded.seconds, "note": graded.note}


def run_grading(mode: str, inbox: Path, out: Path, alone: bool) -> dict[str, dict]:
    """Grade the forgery alone (into ``out/m_forgery``) or the whole folder (into ``out``)."""
    args = {"out": str(out / FORGERY if alone else out), "edition": "2025", "only": [ZERO], "select": SELECT,
            "test_timeout_s": LIMITS.test_timeout_s, "submission_timeout_s": LIMITS.submission_timeout_s,
            "jobs": 2, **({"submission": str(inbox / FORGERY)} if alone else {"folder": str(inbox)})}
    if mode == "namespaces":
        if not namespaces_available():
            pytest.skip("this machine makes no namespaces")
        if alone:
            graded = [grade(inbox / FORGERY, out / FORGERY, 1, "2025", LIMITS, quiet=True, only=(ZERO,), select=SELECT)]
        else:
            graded = grade_folder(inbox, out, 1, "2025", LIMITS, 2, (ZERO,), SELECT, quiet=True)
        return {g.name: summary(g) for g in graded}
    if not student.can_switch() or shutil.which("unshare") is None:
        pytest.skip("the fallback as root needs root")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-m",
                           "tests.fallback_grade", json.dumps(args)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def left_by_students() -> list[str]:
    """Entries in the shared folders owned by a uid of the student range (none once a grading ends)."""
    found = []
    for folder in student.SHARED_FOLDERS:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        found += [e.path for e in entries
                  if student.FIRST_UID <= e.stat(follow_symlinks=False).st_uid < student.FIRST_UID + student.UIDS]
    return found


def running(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


@pytest.mark.parametrize("kind, mode, where", CASES)
def test_a_hostile_submission_gets_what_its_code_deserves(tmp_path, kind, mode, where):
    inbox, out, marker = tmp_path / "inbox", tmp_path / "out", uuid.uuid4().hex
    inbox.mkdir()
    canary = tmp_path / "canary.txt"
    canary.write_text("")
    dev_canary = Path(f"/dev/grading-canary-{marker}")
    victims = [build(inbox, "a_victim"), build(inbox, "z_victim")] if where == "folder" else []
    outputs = [out / v / f for v in ("a_victim", "z_victim", FORGERY) for f in ("grade.json", "results.json")]
    hostile(inbox, kind, FORGERY, canary=canary, marker=marker, dev_canary=dev_canary, outputs=[*outputs, canary],
            victims=[*(v / "tests" / "adapters.py" for v in victims), canary])
    before = snapshot(inbox)
    start = time.monotonic()
    try:
        if student.can_switch():
            dev_canary.write_text("")
        graded = run_grading(mode, inbox, out, alone=where == "alone")
        if kind in ("daemon", "all"):
            time.sleep(3)  # the daemon, had it survived, rewrote the results after 2 s
        forged = graded[FORGERY]
        assert forged["points"] == {ZERO: 15.0 if kind in ("discovery", "links") else 0.0}, forged["outputs"]
        assert all(r == 1 for r in forged["runs"]), "a forged outcome reached the harness"
        assert all(REASON[kind] in line for line in forged["outputs"] if not line.startswith("passed")), forged
        for victim in victims:
            assert graded[victim.name]["points"] == {ZERO: 15.0}, graded[victim.name]["outputs"]
        assert all(g["seconds"] < LIMITS.submission_timeout_s for g in graded.values())
        results = json.loads((out / FORGERY / "results.json").read_text())
        assert results["score"] == pytest.approx(forged["points"][ZERO]), "results.json changed after grading"
        if kind == "discovery":
            lines = (out / FORGERY / "grade.md").read_text()
            assert "'/' is absolute or outside the submission: not used" in lines
            assert "'../..' is absolute or outside the submission: not used" in lines
        if kind == "links":
            assert "Links and special files are not graded (left out of the copy)" in (out / FORGERY / "grade.md").read_text()
        if where == "folder":  # a rerun trusts only the grades this OUT signed
            again = run_grading(mode, inbox, out, alone=False)
            assert {n: g["points"] for n, g in again.items()} == {n: g["points"] for n, g in graded.items()}
    finally:
        dev_left = dev_canary.exists()
        dev_canary.unlink(missing_ok=True)
        Path(f"/dev/grading-probe-{marker}").unlink(missing_ok=True)
    assert time.monotonic() - start < 900
    assert snapshot(inbox) == before, "the folder of submissions changed"
    assert canary.read_text() == ""
    assert dev_left or not student.can_switch(), "a file in /dev was deleted"
    assert not running(marker), "a process of the submission outlived its grading"
    assert not left_by_students(), "a student uid left files in a shared folder"


def test_output_names_are_safe_and_distinct(tmp_path):
    """``alice/`` and ``alice.zip`` get a folder each, ``...zip`` stays inside OUT, and a
    submission named like OUT's own files is renamed, with a line; the folder run completes."""
    inbox, out = tmp_path / "inbox", tmp_path / "out"
    inbox.mkdir()
    (inbox / "alice").mkdir()  # no adapters: graded at once
    (inbox / "grades.csv").mkdir()
    stub = build(tmp_path, "stub", stub=True)
    (stub / "tests" / "adapters.py").write_text("def broken(:\n")
    for name in ("alice.zip", "...zip", "summary.png.zip"):
        with zipfile.ZipFile(inbox / name, "w") as z:
            for file in stub.rglob("*"):
                z.write(file, file.relative_to(stub))
    names, lines = output_names(sorted(inbox.iterdir()))
    assert sorted(names.values()) == ["_..", "alice", "alice.zip", "grades.csv.submission", "summary.png.submission"]
    assert len(lines) == 4
    graded = grade_folder(inbox, out, 1, "2025", LIMITS, 2, (ZERO,), SELECT, quiet=True)
    assert sorted(g.name for g in graded) == sorted(names.values())
    assert "no adapters file" in (out / "alice" / "grade.md").read_text()
    assert "SyntaxError" in (out / "alice.zip" / "grade.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inbox", "out", "stub"]
    assert len((out / "grades.csv").read_text().splitlines()) == 6  # a header and a row each
    assert (out / "summary.md").is_file() and (out / "summary.png").is_file()


def test_package_discovery_is_bounded_and_stays_inside(tmp_path):
    tree = hostile(tmp_path, "discovery", "deep")
    refused: list[str] = []
    start = time.monotonic()
    roots = python_roots(tree, refused)
    assert time.monotonic() - start < 5
    assert roots[0] == tree and all(tree == r or tree in r.parents for r in roots)
    assert len(refused) == 6 and any("visit more than" in line for line in refused), refused
