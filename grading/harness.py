"""Grading one submission (a checkout or a zip), contained; ``grade`` writes its results.

What a submission gets, and what it does not:
* a scratch copy of its tree, made in a limited subprocess (intake.py) that also finds its
  adapters, edition and packages: folders and regular files only, no link kept or followed, every
  path checked, at most 50,000 files (files.py); never this repository's packages. The scratch
  folder of a grading that was killed is removed by the next one; its code runs only in rank processes (ranks.py), which
  import it after the standard library and site-packages and hold no capability;
* the grade is decided elsewhere: pytest runs the grader's copy of the suite with only the grader
  on its path, trains the reference and compares (checks.py), and sends each outcome to this
  process through a pipe no rank holds; both are not dumpable, so no rank can trace them or open
  their descriptors; the fork server that starts the ranks is confined like a rank
  (rank_server.py);
* a scrubbed environment (PATH, a scratch HOME and TMPDIR, one thread per rank, nothing else);
* ``resource`` limits on every process it starts: address space, CPU time, open files, file size,
  and processes;
* as root, a uid of its own for the fork server and the ranks; with namespaces, private network,
  mount and PID namespaces and the ranks' own view of the file systems (containment.py says what
  each way of running gives);
* a deadline per test (ranks.py) and one for the whole submission; a run whose every test fails
  the same way, slowly, stops early (outcomes.py); the results are written only once every
  process of the run is gone, and not at all if the grader's pytest was interrupted;
* a cgroup of its own where one can be made (share.py): a CPU share and a task limit.
Gradescope runs one container per submission; its ``run_autograder`` (autograder.py) calls
``python -m grading`` on the one submission.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from grading.intake import intake, packages
from grading.intake.submission import AT_IMPORT
from grading.readings import review
from grading.reports import report
from grading.isolation import sandbox, scrub
from grading.isolation.preload import DECLARED_ENV
from grading import selfcheck
from grading.isolation.containment import Containment, ContainmentError, limit, namespaces_available, package_paths
from grading.reports.outcomes import SLOW_FRACTION, Outcomes
from grading.problems import GRADED, hand_graded
from grading.selfcheck import GRADER_FAILURE

__all__ = ["Graded", "Limits", "grade", "grader_commit", "namespaces_available"]

GRADER_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Limits:
    test_timeout_s: float = 60.0  # one test's ranks
    submission_timeout_s: float = 1200.0  # the whole submission
    memory_gb: float = 16.0  # address space of each process
    open_files: int = 4096


@dataclass(frozen=True)
class Graded:
    name: str
    rows: list[report.ProblemGrade]
    tests: list[report.TestGrade]
    seconds: float
    note: str = ""  # why there is no grade (a folder's job that died), "" when graded
    remarks: tuple[str, ...] = ()  # grade.md's lines above the table (a package missing, the edition)


def grader_commit() -> str:
    """The commit of the grader that grades, for a regrade with the same code: the ``COMMIT``
    file an autograder package carries, else git's answer for this checkout ("+changes" when
    the grader's files differ from it)."""
    stamped = GRADER_DIR / "COMMIT"
    if stamped.is_file():
        return stamped.read_text().strip()
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(GRADER_DIR.parent), *args], capture_output=True, text=True,
                              timeout=10)

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        if head.returncode:
            return "unknown (not a git checkout)"
        changed = git("status", "--porcelain", "--", str(GRADER_DIR)).stdout.strip()
        return head.stdout.strip() + ("+changes" if changed else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no git)"


def grade(submission: Path, out: Path, repeats: int = 3, edition: str | None = None,
          limits: Limits = Limits(), quiet: bool = False, keep_scratch: bool = False,
          only: tuple[str, ...] | None = None, select: str | None = None, self_check: bool = True) -> Graded:
    """Grade one checkout or zip into ``out``: results.json, grade.md, and the pytest log.

    ``only`` grades just those problems, and ``select`` (a pytest ``-k`` expression) just those
    tests: the grader's own tests use them to stay quick. The first grading of a process grades
    the grader's own probe first (selfcheck.py): SetupError if this machine cannot run ranks,
    GraderFailure if this submission's ranks could not start; either way nothing is written."""
    sandbox.not_dumpable()  # this process records the grade
    if self_check:
        selfcheck.ensure(limits)
    start = time.monotonic()
    name = submission.resolve().name.removesuffix(".zip")
    out.mkdir(parents=True, exist_ok=True)
    scratch, held = scratch_folder()
    containment = Containment.start(uuid.uuid4().hex)
    notes: dict[str, str] = {}
    try:
        deadline = start + limits.submission_timeout_s
        found = intake.run(submission, scratch / "submission", edition, limits.memory_gb, deadline)
        course_edition, edition = edition, edition or found.detected
        missing = list(found.remarks)
        layer, unavailable = scratch / "packages" / "site-packages", {}
        if found.to_install and not found.problem:
            installed, unavailable = packages.install(found.to_install, layer)
            missing += packages.remarks(installed, unavailable)
        if not found.problem:
            packages.write_metadata([(n, v) for n, v in found.own], layer)
            if absent := packages.absent_imports(found.unresolved, layer):
                missing.insert(0, packages.absent_remark(absent))
        if flag := edition_flag(course_edition, found.answers):
            missing.insert(0, flag)
        if found.problem:
            notes = dict.fromkeys(GRADED[edition], found.problem)
        entries: list[dict] = []
        not_run = "not run"
        if not notes:
            try:
                entries, not_run = _run_suite(scratch, [Path(r) for r in found.roots], edition, repeats, limits,
                                              containment, submission, out, only, select, deadline,
                                              layer if layer.is_dir() else None,
                                              found.preload, packages.provided(found.unresolved, layer))
            except ContainmentError as e:
                notes = dict.fromkeys(GRADED[edition], f"not graded: {e}")
            failed_to_start = [e for e in entries if str(e.get("reason", "")).startswith(GRADER_FAILURE)]
            if failed_to_start:
                raise selfcheck.GraderFailure(f"{failed_to_start[0]['test']}: {failed_to_start[0]['reason']}"[:400])
        problems = report.graded(edition, only)
        if not containment.namespaces and set(problems) & {"fsdp", "ddp_overlap_individual_parameters",
                                                           "ddp_overlap_bucketed"}:
            missing.append(NOT_CHECKED)
        for entry in entries:
            if "reason" in entry and not entry.get("passed") and not str(entry["reason"]).startswith(GRADER_FAILURE):
                reason = packages.hold_unavailable(str(entry["reason"]), list(unavailable))
                entry["reason"] = packages.hold_unrunnable(reason, found.python)
        if why := hold_if_nothing_imports(entries):
            missing.insert(0, why)
        tests = report.grade_tests(entries, problems, notes, not_run)
        rows = report.problem_grades(tests, problems, hand_graded(edition))
        seconds = time.monotonic() - start
        regraded = f"; only {', '.join(only)}" if only else ""
        header = (f"{containment.guarantees(containment.namespaces or sandbox.user_namespaces())}\n\n"
                  f"Edition {edition}; grader commit {grader_commit()}{regraded}; "
                  f"{repeats} run(s) per test, a test scores only if all pass; "
                  f"isolation: {containment.describe()}; graded in {seconds:.0f} s.")
        # every process of the run is gone by now: nothing can rewrite what is written here
        report.write_outputs(out, name, header, tests, rows, seconds, missing,
                             report.Run(edition, grader_commit(), repeats, tuple(only or ())))
        if not quiet:
            print(f"{name}: {header}")
            for line in missing:
                print(line)
            print("\n".join(report.table_lines(rows)))
            print(f"written: {out / 'results.json'}, {out / 'grade.md'}")
        return Graded(name, rows, tests, seconds, remarks=tuple(missing))
    finally:
        containment.release()
        if not keep_scratch:
            scrub.remove_tree(str(scratch))
        os.close(held)


# grade.md's line where the ranks' traffic cannot be read (grading/readings/traffic.py): no namespace of
# their own, so the loopback is the machine's (Gradescope: root without user namespaces).
NOT_CHECKED = ("Not checked on this grader: the bytes the ranks carry, read from outside them on the loopback of the "
               "run's own network namespace, which this machine cannot make. FSDP: test_gradients_are_reduce_scattered "
               "is not run, and the other FSDP tests share its points in proportion (no point lost or gained); DDP: "
               "test_communicates_during_backward is decided by the probe inside the ranks alone.")


SCRATCH_PREFIX = "grade-"


def hold_if_nothing_imports(entries: list[dict]) -> str:
    """Where every test ran and failed while the submission's adapters were imported
    (submission.AT_IMPORT), nothing of its code was graded: an environment that differs from the
    course's (a package's metadata, a module the grader lacks) zeroes it as surely as a bug. Each
    such test is held for review with its import error, never zeroed in silence; grade.md's first
    line says so (with the error). "" where some test got past the import."""
    runs = [e for e in entries if "test" in e]  # not the collection's entries (plugin.py)
    failed = [e for e in runs if not e.get("passed")]
    if not failed or len(failed) < len(runs) or any(AT_IMPORT not in str(e.get("reason", "")) for e in failed):
        return ""
    first = str(failed[0]["reason"])
    for entry in failed:
        if not review.is_held(str(entry["reason"])):
            entry["reason"] = review.held("every test failed while the submission's adapters were imported, so "
                                          "none of its code was graded: a TA checks the error in the course's "
                                          "environment", str(entry["reason"]))
    return f"Every test failed at import, held for review (not graded): {first}"


def edition_flag(course: str | None, answers: str | None) -> str | None:
    """grade.md's line for a submission that answers the other edition's adapters than the
    course's (pinned: ``--edition``, the autograder package's EDITION); it is graded as the course's."""
    if course in (None, "both") or answers in (None, course):
        return None
    return (f"This submission answers the {answers} edition's adapters; it is graded against the course's "
            f"{course} rubric (out of its total).")


def scratch_folder() -> tuple[Path, int]:
    """A new scratch folder, and a descriptor holding an ``flock`` on it for as long as this
    grading runs; first, the scratch folders of gradings that died (killed, out of memory)
    are removed: their lock is free."""
    base = Path(tempfile.gettempdir())
    try:
        stale = [e for e in os.scandir(base) if e.name.startswith(SCRATCH_PREFIX)]
    except OSError:
        stale = []
    for entry in stale:
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            scrub.remove_tree(entry.path)  # no link followed, any depth, never raises
        except BlockingIOError:
            pass  # a grading in progress
        finally:
            os.close(fd)
    scratch = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX))
    held = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    fcntl.flock(held, fcntl.LOCK_EX)
    return scratch, held


def _run_suite(scratch: Path, roots: list[Path], edition: str, repeats: int, limits: Limits,
               containment: Containment, submission: Path, out: Path, only: tuple[str, ...] | None,
               select: str | None, deadline: float, layer: Path | None = None,
               preload: list[str] = (), declared: list[str] = ()) -> tuple[list[dict], str]:
    """Run the suite on the submission in a contained process; the outcomes its plugin sent.

    pytest imports only the grader's copy (its path is that copy and site-packages: never the
    submission's folders, never this repository); the submission's folders reach the ranks as
    a variable, and they put them last on their own path. pytest's temporary folder (the fork
    server's socket) is the grader's alone; the ranks get the submission's home. Returns only
    once every process of the run is gone. ``layer``: the packages installed for this submission
    (packages.py), read-only to the ranks, on their path after the submission's folders;
    ``preload``: the environment's libraries the fork server imports for them, ``declared`` the
    modules of the layer's packages each rank imports itself (grading/isolation/preload.py)."""
    grader, private, home = scratch / "grader", scratch / "private", scratch / "home"
    shutil.copytree(GRADER_DIR, grader / "grading", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (grader / "pytest.ini").write_text("[pytest]\n")
    private.mkdir(mode=0o700)
    (home / "tmp").mkdir(parents=True)
    (home / "shm").mkdir()
    # Where each rank can have storage of its own (sandbox.private_storage), the submission's copy
    # is read-only to the ranks, and each sees it writable at its own working folder; elsewhere
    # it stays writable, as before, and shared by the ranks of a test.
    read_only = containment.namespaces or sandbox.user_namespaces()
    tree = scratch / "submission"
    writable = [home] if read_only else [tree, home]
    view = containment.hand_over(scratch, writable, out, hidden=[scratch.parent, private, out.parent, out,
                                                                  submission.resolve().parent, GRADER_DIR.parent],
                                 keep=[grader, tree, *([layer] if layer else [])],
                                 readable=[*([tree] if read_only else []), *([layer] if layer else [])])
    installed = package_paths()  # where this Python's packages live beyond site-packages
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TMPDIR": str(private),
        "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join([str(grader), *installed]), "PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1",
        "GRADING_PACKAGE_PATHS": os.pathsep.join(installed),
        "GRADING_TOKEN": containment.token, "GRADING_EDITION": edition,
        "GRADING_SUBMISSION_ROOTS": os.pathsep.join(map(str, roots)),
        **({packages.LAYER_ENV: str(layer)} if layer else {}),
        packages.PRELOAD_ENV: ",".join(preload), DECLARED_ENV: ",".join(declared),
        **({sandbox.PRIVATE_STORAGE_ENV: "0"} if not sandbox.user_namespaces_allowed() else {}),
        **({sandbox.DISK_ENV: os.pathsep.join(map(str, writable))} if not read_only else {}),
        "GRADING_TEST_TIMEOUT": str(limits.test_timeout_s),
        "GRADING_HIDE": str(GRADER_DIR.parent),  # this repository, if installed: never the submission's
        "GRADING_WRITABLE": os.pathsep.join(map(str, writable)),
        "GRADING_RANK_SERVER": "1", "GRADING_RANK_TMPDIR": str(home / "tmp"), "GRADING_RANK_SHM": str(home / "shm"),
        **({"GRADING_TREE_READ_ONLY": "1"} if read_only else {}),
        **view, **containment.env(),
    }
    if only:
        env["GRADING_PROBLEMS"] = ",".join(only)
    reader, writer = os.pipe()
    pytest_args = ["-c", str(grader / "pytest.ini"), "--rootdir", str(grader),
                   "-p", "grading.reports.plugin", "-p", "no:cacheprovider", "-q", "--tb=short",
                   f"--grading-repeats={repeats}", f"--grading-fd={writer}",
                   "-o", f"timeout={int(limits.test_timeout_s + 60)}", "-o", "timeout_method=thread",
                   str(grader / "grading" / "suite"), *(["-k", select] if select else [])]
    command = containment.command([sys.executable, "-m", "grading.isolation.sandbox", *pytest_args])
    not_run = "not run"
    cpu_s = int(limits.submission_timeout_s * 2)
    with open(out / "pytest.log", "wb") as log:
        proc = subprocess.Popen(command, cwd=grader, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(writer,),
                                preexec_fn=containment.preexec(limit(limits.memory_gb, cpu_s, limits.open_files)))
        os.close(writer)
        outcomes = Outcomes(reader, limits.test_timeout_s)
        try:
            while proc.poll() is None and not outcomes.stop.is_set() and time.monotonic() < deadline:
                outcomes.stop.wait(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            if outcomes.stop.is_set():
                not_run = (f"not run: every test so far failed the same way after at least "
                           f"{SLOW_FRACTION * limits.test_timeout_s:.0f} s ({outcomes.stop_reason[:200]}), "
                           "so the grading stopped early, as after a hang")
            elif proc.poll() is None:
                not_run = f"not run: the submission's time limit of {limits.submission_timeout_s:.0f} s was reached"
        finally:
            containment.stop(proc)
            outcomes.join(timeout=10)
    entries = outcomes.entries
    if not entries:  # the suite never imports the submission: its failure to start is the grader's
        text = [ln.strip() for ln in _tail(out / "pytest.log").splitlines() if ln.strip()]
        errors = [ln for ln in text if "Error" in ln]
        raise selfcheck.GraderFailure(f"the suite did not start: {(errors or text or ['no output'])[-1][:300]}")
    if not_run == "not run" and (missing := outcomes.missing_runs(repeats)):
        last = [ln.strip() for ln in _tail(out / "pytest.log").splitlines() if ln.strip()] or ["no output"]
        raise selfcheck.GraderFailure(f"grader interrupted (pytest exit status {proc.returncode}, {missing} test "
                                      f"run(s) not run: {last[-1][:200]}); no grade written: grade it again")
    return entries, not_run


def _tail(path: Path, size: int = 64 << 10) -> str:
    """The last ``size`` bytes of a log the grader wrote (it may be large)."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - size))
        return f.read().decode(errors="replace")
