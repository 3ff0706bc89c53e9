"""What the harness reads from a submission, as root: nothing through a link, regular files only,
bounded, in a limited subprocess; and nothing left behind by a grading that was killed.

Each hostile tree is the attack a reviewer ran against 93fe110 (issue 38, item 3): a
``pyproject.toml`` linked to ``/dev/zero`` (the harness was OOM-killed) or ``/proc/self/fd/0``
(the harness blocked on its own stdin), an adapters file linked to another process's descriptor,
a FIFO where a file should be. All run without a rank, so each costs well under a second.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import pytest

from grading import harness
from grading.intake import intake
from grading.intake.files import MAX_TEXT_BYTES, read_regular, unpack
from grading.course.autograder import build
from grading.intake.submission import missing_packages, uninitialised_submodules
from tests.answers_fixture import adapters_text, build_answers_submission

pytestmark = pytest.mark.problem("beyond")


def hostile_tree(tmp_path: Path) -> Path:
    """The answers' submission with every link and special file the reviewer used."""
    tree = build_answers_submission(tmp_path / "hostile")
    (tree / "pyproject.toml").symlink_to("/dev/zero")
    (tree / "stdin.toml").symlink_to("/proc/self/fd/0")
    (tree / "neighbour").symlink_to("/proc/self/fd/3")
    (tree / "outside").symlink_to("/etc", target_is_directory=True)
    os.mkfifo(tree / "fifo.py")
    return tree


def test_a_checkout_is_copied_without_links_or_special_files(tmp_path):
    copy = tmp_path / "copy"
    dropped = unpack(hostile_tree(tmp_path), copy)
    assert sorted(dropped) == ["fifo.py", "neighbour", "outside", "pyproject.toml", "stdin.toml"]
    every = list(copy.rglob("*"))
    assert every and not [p for p in every if p.is_symlink() or not (p.is_file() or p.is_dir())]
    assert (copy / "tests" / "adapters.py").read_text() == adapters_text()


def test_reading_refuses_links_special_files_and_large_files(tmp_path):
    tree = hostile_tree(tmp_path)
    for name in ("pyproject.toml", "stdin.toml", "neighbour", "fifo.py"):
        started = time.monotonic()
        with pytest.raises(OSError):
            read_regular(tree / name)
        assert time.monotonic() - started < 1.0, name  # never blocks on a FIFO or a descriptor
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (MAX_TEXT_BYTES + 1))
    with pytest.raises(OSError, match="larger than"):
        read_regular(big)
    assert read_regular(tree / "tests" / "adapters.py")


def test_intake_of_a_hostile_tree_finishes_with_what_grading_needs(tmp_path):
    started = time.monotonic()
    found = intake.run(hostile_tree(tmp_path), tmp_path / "scratch" / "submission", None, 16.0, time.monotonic() + 60)
    assert time.monotonic() - started < 30
    assert not found.problem and found.detected == "2026" and found.answers is None  # it answers both
    assert any("cs336-basics" in r for r in found.roots)
    assert any("not graded (left out of the copy)" in r and "pyproject.toml" in r for r in found.remarks)


def test_intake_that_blocks_is_stopped_at_the_submissions_time_limit(tmp_path):
    fifo = tmp_path / "blocks.zip"  # opening a FIFO for reading waits for a writer that never comes
    os.mkfifo(fifo)
    started = time.monotonic()
    found = intake.run(fifo, tmp_path / "scratch" / "submission", "2026", 16.0, time.monotonic() + 2)
    assert time.monotonic() - started < 15
    assert found.problem.startswith("could not unpack the submission: reading it took more than")


def test_a_killed_gradings_scratch_is_removed_by_the_next_one(tmp_path, monkeypatch):
    monkeypatch.setattr(harness.tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / f"{harness.SCRATCH_PREFIX}dead"
    (dead / "submission").mkdir(parents=True)
    alive = tmp_path / f"{harness.SCRATCH_PREFIX}alive"
    alive.mkdir()
    held_by_other = os.open(alive, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held_by_other, fcntl.LOCK_EX)
        scratch, held = harness.scratch_folder()
        os.close(held)
        assert not dead.exists() and alive.exists() and scratch.exists()
    finally:
        os.close(held_by_other)


def test_an_uninitialised_submodule_is_named_as_such(tmp_path):
    root = tmp_path / "checkout"
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "adapters.py").write_text("import cs336_basics\n")
    (root / "cs336-basics").mkdir()
    (root / ".gitmodules").write_text('[submodule "cs336-basics"]\n\tpath = cs336-basics\n'
                                      "\turl = https://github.com/stanford-cs336/assignment1-basics\n")
    assert uninitialised_submodules(root) == ["cs336-basics"]
    lines = missing_packages(root, root / "tests" / "adapters.py", "2026")
    assert lines == [line for line in lines if line.startswith("git submodule not initialised: cs336-basics "
                                                                "(upload with submodules")] and lines
    (root / ".gitmodules").unlink()
    (root / ".gitmodules").symlink_to("/dev/zero")
    assert uninitialised_submodules(root) == []


ANSWERS_2025 = """
def get_ddp_individual_parameters(module):
    return module

def get_ddp_bucketed(module, bucket_size_mb):
    return module

def get_sharded_optimizer(params, optimizer_cls, **kwargs):
    return optimizer_cls(params, **kwargs)

def get_ddp(module):
    return module

def get_fsdp(module, compute_dtype=None):
    raise NotImplementedError
"""


def test_a_submission_answering_the_other_edition_is_graded_as_the_course_and_flagged(tmp_path):
    tree = tmp_path / "bucketed"
    (tree / "tests").mkdir(parents=True)
    (tree / "tests" / "adapters.py").write_text(ANSWERS_2025)
    found = intake.run(tree, tmp_path / "scratch" / "submission", "2026", 16.0, time.monotonic() + 60)
    assert found.answers == "2025" and found.detected == "2025"
    assert "answers the 2025 edition's adapters" in harness.edition_flag("2026", found.answers)
    assert "course's 2026 rubric" in harness.edition_flag("2026", found.answers)
    assert harness.edition_flag("2025", found.answers) is None and harness.edition_flag(None, "2025") is None


def test_the_autograder_package_pins_the_courses_edition(tmp_path):
    import zipfile

    for course in ("2025", "2026"):
        with zipfile.ZipFile(build(tmp_path / f"{course}.zip", course)) as z:
            assert z.read("grading/EDITION").decode().strip() == course
            assert '--edition "$(cat "$ROOT/source/grading/EDITION")"' in z.read("run_autograder").decode()
    with pytest.raises(ValueError, match="course's edition"):
        build(tmp_path / "both.zip", "both")


def test_the_submodule_line_is_short_where_staff_read_it(tmp_path):
    from grading.harness import Graded
    from grading.reports.summary import short_remarks

    root = tmp_path / "checkout"
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "adapters.py").write_text("import cs336_basics\n")
    (root / ".gitmodules").write_text('[submodule "cs336-basics"]\n\tpath = cs336-basics\n')
    lines = missing_packages(root, root / "tests" / "adapters.py", "2026")
    assert short_remarks(Graded("x", [], [], 0.0, remarks=tuple(lines))) == (
        "git submodule not initialised: cs336-basics (upload with submodules)")


def test_a_folder_others_can_read_is_refused_without_namespaces_unless_asked(tmp_path, monkeypatch):
    from grading.course import course
    from grading.isolation import student
    from grading.selfcheck import SetupError

    if not student.can_switch():
        pytest.skip("the refusal is for a grader running as root")
    monkeypatch.setattr(course, "namespaces_available", lambda: False)
    monkeypatch.setattr(course, "_open_to_others", lambda path: True)
    inbox = tmp_path / "inbox"
    inbox.mkdir(mode=0o755)
    with pytest.raises(SetupError, match=r"chmod 700 .*--make-private"):
        course.check_private(inbox, make_private=False, quiet=True)
    assert inbox.stat().st_mode & 0o777 == 0o755  # not changed unasked
    course.check_private(inbox, make_private=True, quiet=True)
    assert inbox.stat().st_mode & 0o777 == 0o700
    monkeypatch.undo()
    shut = tmp_path / "shut"
    shut.mkdir(mode=0o700)
    assert not course._open_to_others(shut)
