"""Grading one submission (a checkout or a zip) or a folder of them, contained.

What a submission gets, and what it does not:
* a scratch copy of its tree (a zip is unpacked with every path checked), never this repository's
  packages; its code runs only in rank processes (ranks.py), which import it after the standard
  library and site-packages and hold no capability;
* the grade is decided elsewhere: pytest runs the grader's copy of the suite with only the grader
  on its path, trains the reference and compares (checks.py), and sends each outcome to this
  process through a pipe no rank holds; both are not dumpable, so no rank can trace them or open
  their descriptors;
* a scrubbed environment (PATH, a scratch HOME and TMPDIR, one thread per rank, nothing else);
* ``resource`` limits on every process it starts: address space, CPU time, open files, file size;
* where Linux allows it (``unshare -rn`` as an unprivileged user), private user, network, mount and
  PID namespaces: its own loopback (fixed ports never collide between submissions graded side by
  side, and there is no network), a read-only view of every file system but its scratch folders
  (sandbox.py), its own /proc, in which this process and other submissions' do not appear, and
  every process it started dies with the namespace;
* without namespaces, its own session: the process group, then every process carrying the run's
  token in its environment, is killed at the end (a double-forked daemon included);
* a deadline per test (ranks.py) and one for the whole submission.
It is no container: the submission can read what this user can read. Gradescope runs one
container per submission; ``grading/run_autograder`` is the entry point for that.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

from grading import report
from grading.problems import GRADED, hand_graded
from grading.sandbox import not_dumpable
from grading.submission import adapters_file, detect_edition, find_root, missing_packages, python_roots

GRADER_DIR = Path(__file__).resolve().parent
MAX_UNPACKED_BYTES = 2 << 30
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", "node_modules", "wandb", ".mypy_cache"}
MAX_FILE_BYTES = 64 << 20  # larger files (checkpoints, data) are left out of the scratch copy


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


def unpack(submission: Path, dest: Path) -> None:
    """Copy a checkout, or unpack a zip, into ``dest`` (no links followed, no path outside it)."""
    if submission.is_dir():
        def ignore(folder: str, names: list[str]) -> set[str]:
            return {n for n in names if n in SKIP_DIRS or n.endswith(".pyc")
                    or (os.path.isfile(os.path.join(folder, n)) and os.path.getsize(os.path.join(folder, n)) > MAX_FILE_BYTES)}
        shutil.copytree(submission, dest, symlinks=True, ignore=ignore)
        return
    dest.mkdir(parents=True)
    with zipfile.ZipFile(submission) as z:
        total = 0
        for info in z.infolist():
            target = (dest / info.filename).resolve()
            if not str(target).startswith(str(dest.resolve()) + os.sep) or info.is_dir():
                continue
            if (info.external_attr >> 16) & 0o170000 == 0o120000:  # a symbolic link
                continue
            total += info.file_size
            if total > MAX_UNPACKED_BYTES:
                raise ValueError(f"{submission.name} unpacks to more than {MAX_UNPACKED_BYTES >> 30} GiB")
            if info.file_size > MAX_FILE_BYTES or any(part in SKIP_DIRS for part in Path(info.filename).parts):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)


def namespaces_available() -> bool:
    """Whether this user can make private user, network and PID namespaces here."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "true"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _limit(limits: Limits):
    def apply() -> None:
        import resource
        memory = int(limits.memory_gb * (1 << 30))
        cpu = int(limits.submission_timeout_s * 2)
        for what, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu),
                            (resource.RLIMIT_NOFILE, limits.open_files), (resource.RLIMIT_FSIZE, 1 << 30),
                            (resource.RLIMIT_CORE, 0)):
            soft, hard = resource.getrlimit(what)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(what, (value, value))
    return apply


def kill_tagged(token: str) -> int:
    """SIGKILL every process whose environment carries ``GRADING_TOKEN=token``; how many."""
    needle = f"GRADING_TOKEN={token}".encode()
    killed = 0
    for _ in range(3):  # a process may fork while we look
        found = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        os.kill(int(pid), signal.SIGKILL)
                        found += 1
            except (OSError, ProcessLookupError):
                continue
        killed += found
        if not found:
            break
        time.sleep(0.2)
    return killed


def syntax_error(path: Path, root: Path) -> str | None:
    try:
        ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as e:
        return f"{path.relative_to(root)}:{e.lineno}: SyntaxError: {e.msg}"
    return None


def grade(submission: Path, out: Path, repeats: int = 3, edition: str | None = None,
          limits: Limits = Limits(), quiet: bool = False, keep_scratch: bool = False,
          only: tuple[str, ...] | None = None, select: str | None = None) -> Graded:
    """Grade one checkout or zip into ``out``: results.json, grade.md, and the pytest log.

    ``only`` grades just those problems, and ``select`` (a pytest ``-k`` expression) just those
    tests: the grader's own tests use them to stay quick."""
    not_dumpable()  # this process records the grade
    start = time.monotonic()
    name = submission.resolve().name.removesuffix(".zip")
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"grade-{name[:40]}-"))
    token = uuid.uuid4().hex
    notes: dict[str, str] = {}
    isolation = "scratch copy, scrubbed environment, resource limits"
    try:
        tree = scratch / "submission"
        try:
            unpack(submission, tree)
        except (OSError, ValueError, zipfile.BadZipFile) as e:
            notes = dict.fromkeys(GRADED[edition or "2026"], f"could not unpack the submission: {e}")
        root = find_root(tree)
        edition = edition or detect_edition(root)
        adapters = adapters_file(root) if tree.exists() else None
        if not notes and adapters is None:
            notes = dict.fromkeys(GRADED[edition], "no adapters file (tests/adapters.py or adapters.py) in the submission")
        elif not notes and (error := syntax_error(adapters, root)):
            notes = dict.fromkeys(GRADED[edition], error)
        entries: list[dict] = []
        not_run = "not run"
        missing = missing_packages(root, adapters, edition) if not notes else []
        if not notes:
            use_namespaces = namespaces_available()
            if use_namespaces:
                isolation += ", private network, mount and PID namespaces, read-only file systems"
            entries, not_run = _run_suite(scratch, root, edition, repeats, limits, token, use_namespaces, out,
                                          only, select)
        problems = report.graded(edition, only)
        tests = report.grade_tests(entries, problems, notes, not_run)
        rows = report.problem_grades(tests, problems, hand_graded(edition))
        seconds = time.monotonic() - start
        regraded = f"; only {', '.join(only)}" if only else ""
        header = (f"Edition {edition}; grader commit {grader_commit()}{regraded}; "
                  f"{repeats} run(s) per test, a test scores only if all pass; "
                  f"isolation: {isolation}; graded in {seconds:.0f} s.")
        report.write_outputs(out, name, header, tests, rows, seconds, missing,
                             report.Run(edition, grader_commit(), repeats, tuple(only or ())))
        if not quiet:
            print(f"{name}: {header}")
            for line in missing:
                print(line)
            print("\n".join(report.table_lines(rows)))
            print(f"written: {out / 'results.json'}, {out / 'grade.md'}")
        return Graded(name, rows, tests, seconds)
    finally:
        kill_tagged(token)
        if not keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def _run_suite(scratch: Path, root: Path, edition: str, repeats: int, limits: Limits, token: str,
               use_namespaces: bool, out: Path, only: tuple[str, ...] | None,
               select: str | None = None) -> tuple[list[dict], str]:
    """Run the suite on the submission in a contained process; the outcomes its plugin sent.

    pytest imports only the grader's copy (its path is that copy and site-packages: never the
    submission's folders, never this repository); the submission's folders reach the ranks as
    a variable, and they put them last on their own path."""
    grader = scratch / "grader"
    shutil.copytree(GRADER_DIR, grader / "grading", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (grader / "pytest.ini").write_text("[pytest]\n")
    home = scratch / "home"
    (home / "tmp").mkdir(parents=True)
    roots = python_roots(root)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TMPDIR": str(home / "tmp"),
        "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": str(grader), "PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1",
        "GRADING_TOKEN": token, "GRADING_EDITION": edition,
        "GRADING_SUBMISSION_ROOTS": os.pathsep.join(map(str, roots)),
        "GRADING_TEST_TIMEOUT": str(limits.test_timeout_s),
        "GRADING_HIDE": str(GRADER_DIR.parent),  # this repository, if installed: never the submission's
        "GRADING_WRITABLE": os.pathsep.join([str(scratch / "submission"), str(home)]),
    }
    if only:
        env["GRADING_PROBLEMS"] = ",".join(only)
    reader, writer = os.pipe()
    pytest_args = ["-c", str(grader / "pytest.ini"), "--rootdir", str(grader),
                   "-p", "grading.plugin", "-p", "no:cacheprovider", "-q", "--tb=short",
                   f"--grading-repeats={repeats}", f"--grading-fd={writer}",
                   "-o", f"timeout={int(limits.test_timeout_s + 60)}", str(grader / "grading" / "suite"),
                   *(["-k", select] if select else [])]
    command = [sys.executable, "-m", "grading.sandbox", *pytest_args]
    if use_namespaces:
        env["GRADING_NETNS"] = "1"
        command = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--mount", "--mount-proc", "--fork",
                   "--kill-child", *command]
    not_run = "not run"
    lines: list[bytes] = []
    with open(out / "pytest.log", "wb") as log:
        proc = subprocess.Popen(command, cwd=grader, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_limit(limits),
                                pass_fds=(writer,))
        os.close(writer)
        collector = threading.Thread(target=_collect, args=(reader, lines), daemon=True)
        collector.start()
        try:
            proc.wait(timeout=limits.submission_timeout_s)
        except subprocess.TimeoutExpired:
            not_run = f"not run: the submission's time limit of {limits.submission_timeout_s:.0f} s was reached"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            kill_tagged(token)
            collector.join(timeout=10)
    if proc.returncode not in (0, 1, 5) and not_run == "not run":  # 1: some test failed; 5: none selected
        not_run = f"not run: the suite stopped (pytest exit status {proc.returncode})"
    entries = []
    for line in b"".join(lines).splitlines():
        try:
            entries.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
    if not entries:  # the suite itself could not start: say why, in one line, from its log
        text = [ln.strip() for ln in (out / "pytest.log").read_text(errors="replace").splitlines() if ln.strip()]
        errors = [ln for ln in text if "Error" in ln]
        not_run = f"the suite did not start: {(errors or text or ['no output'])[-1][:300]}"
    return entries, not_run


def _collect(fd: int, into: list[bytes]) -> None:
    """Read the plugin's outcomes until pytest (the only holder of the write end) is gone."""
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(1 << 16):
            into.append(chunk)
