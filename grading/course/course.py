"""Grading a whole course: every checkout and zip in a folder, here or one job each on a cluster.

Each submission is graded by ``harness.grade``, contained exactly as when graded alone, into
``OUT/<name>/`` (results.json, grade.md, grade.json). Where the grading runs:

* ``inprocess``: ``jobs`` submissions at once on this machine, each by a process of its own;
* ``local``: the same path as a cluster, through submitit's local executor (one process per job);
* ``slurm``: one SLURM job per submission through submitit, on ``partition``.

Every result is gathered into ``OUT/grades.csv`` (one row per submission; a submission whose job
died gets a row whose note says why), ``OUT/summary.md`` and ``OUT/summary.png`` (summary.py).
A rerun skips submissions whose ``grade.json`` is there and carries this OUT's signature (an HMAC
under ``OUT/.grading-key``, a key no submission sees), unless ``regrade``.

Output folders are named after the submission, made safe (``output_names``): letters, digits,
``._-`` and nothing that starts with a dot; a name OUT's own files use (grades.csv, summary.md,
summary.png, jobs) or another submission's (``alice/`` and ``alice.zip``) is renamed, with a line.
As root without namespaces, a folder of submissions that other users can read is refused with
a one-line instruction (``chmod 700``, ``--make-private``, or a private copy): the student uid that
runs a submission's code must not read the others, and a TA's folder is not changed unasked.
OUT, when the grader makes it, is private (0700) from the start.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import time
from collections import Counter
from multiprocessing import connection as mp_connection
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from grading.reports import report, summary
from grading import selfcheck
from grading.isolation import student
from grading.isolation.containment import namespaces_available
from grading.harness import Graded, Limits, grade

EXECUTORS = ("inprocess", "local", "slurm")
KEY_FILE, SIGNATURE = ".grading-key", "grade.sig"
RESERVED = {"grades.csv", "summary.md", "summary.png", "jobs"}  # OUT's own files and folders


def submissions(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if (p.is_dir() and not p.name.startswith(".")) or p.suffix == ".zip")


def name_of(submission: Path) -> str:
    return submission.name.removesuffix(".zip")


def safe_name(name: str) -> str:
    """``name`` as one harmless path component: ``[A-Za-z0-9._-]`` only, never starting with a dot."""
    clean = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100]
    return clean if clean and not clean.startswith(".") else f"_{clean}"


def output_names(found: list[Path]) -> tuple[dict[Path, str], list[str]]:
    """Each submission's output folder name, all distinct; a line for each that is not its own name."""
    bases = {s: safe_name(name_of(s)) for s in found}
    shared = Counter(b.lower() for b in bases.values())
    names: dict[Path, str] = {}
    lines, taken = [], set()
    for submission in found:
        name, why = bases[submission], "" if bases[submission] == name_of(submission) else "made safe"
        if shared[name.lower()] > 1 and submission.suffix == ".zip":
            name, why = safe_name(submission.name), "another submission's name"
        if name.lower() in RESERVED:
            name, why = f"{name}.submission", "a name of OUT's own files"
        base, n = name, 2
        while name.lower() in taken:
            name, n, why = f"{base}-{n}", n + 1, "another submission's name"
        taken.add(name.lower())
        names[submission] = name
        if why:
            lines.append(f"{submission.name}: graded into {name}/ ({why})")
    return names, lines


def _key(out: Path) -> bytes:
    """This OUT's signing key, made once (readable by the grader's user alone)."""
    path = out / KEY_FILE
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32).hex().encode())
    except FileExistsError:
        pass
    return path.read_bytes().strip()


def _signature(key: bytes, folder: Path) -> str:
    return hmac.new(key, (folder / report.GRADE_RECORD).read_bytes(), hashlib.sha256).hexdigest()


def _sign(key: bytes, folder: Path) -> None:
    try:
        (folder / SIGNATURE).write_text(_signature(key, folder) + "\n")
    except OSError:
        pass  # nothing recorded: graded again next time


def _open_to_others(path: Path) -> bool:
    """Whether a user other than its owner may reach ``path`` (every folder on the way enterable)
    and read or enter it."""
    here = path.resolve()
    if not here.stat().st_mode & 0o005:
        return False
    return all(parent.stat().st_mode & 0o001 for parent in here.parents)


def check_private(folder: Path, make_private: bool, quiet: bool) -> None:
    """As root without namespaces, a submission's uid could read every other submission in
    ``folder`` if other users may: refuse, with what to do, unless ``make_private`` (then it is
    made 0700, with a line). A TA's folder is never changed without being asked. With namespaces
    the folder is covered in the ranks' view, and as a user the ranks read what that user reads."""
    if not student.can_switch() or namespaces_available() or not _open_to_others(folder):
        return
    if not make_private:
        raise selfcheck.SetupError(
            f"{folder} can be read by other users, so a submission's uid could read the others (no namespaces "
            f"here): run `chmod 700 {folder}`, pass --make-private to let the grader do it, or grade a private "
            "copy (cp -r) of it")
    os.chmod(folder, 0o700)
    if not quiet:
        print(f"{folder}: made private to root (mode 0700, --make-private): a submission's uid must not read it")


def grade_one(submission: Path, out: Path, repeats: int, edition: str | None, limits: Limits,
              only: tuple[str, ...] | None, select: str | None, self_check: bool = True) -> Graded:
    """One submission, as a job runs it (module level: submitit pickles it by name)."""
    return grade(submission, out, repeats, edition, limits, quiet=True, only=only, select=select,
                 self_check=self_check)


def _already(folder: Path, key: bytes) -> Graded | None:
    """The grade recorded in ``folder`` if this OUT signed it, else None (grade again)."""
    try:
        signed = (folder / SIGNATURE).read_text().strip()
        if not hmac.compare_digest(signed, _signature(key, folder)):
            return None
        rows, tests, seconds = report.load_grade(folder)
        remarks = tuple(json.loads((folder / report.GRADE_RECORD).read_text()).get("notes") or ())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Graded(folder.name, rows, tests, seconds, remarks=remarks)


def _died(submission: Path, error: BaseException, seconds: float) -> Graded:
    """A row for a submission whose grading died: the innermost error's line (a submitit job's
    error carries the job's traceback; its last error line is the cause)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    cause = next((ln for ln in reversed(lines) if "Error:" in ln or "Exception:" in ln), None)
    cause = cause or f"{type(error).__name__}: {lines[-1] if lines else ''}"
    return Graded(name_of(submission), [], [], seconds, f"not graded: {cause}"[:300])


def grade_folder(folder: Path, out: Path, repeats: int, edition: str | None, limits: Limits, jobs: int,
                 only: tuple[str, ...] | None = None, select: str | None = None, executor: str = "inprocess",
                 partition: str | None = None, regrade: bool = False, quiet: bool = False,
                 make_private: bool = False) -> list[Graded]:
    """Grade every checkout and zip in ``folder`` into ``out``; writes grades.csv and the summary."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    start = time.monotonic()
    check_private(folder, make_private, quiet)  # SetupError: nothing graded, nothing written
    if executor == "inprocess":  # a job on another node checks its own machine (harness.grade)
        selfcheck.ensure(limits)  # SetupError: nothing graded, nothing written
    if not out.exists():
        out.mkdir(parents=True, mode=0o700)  # ours: private from the start
    key = _key(out)
    found = submissions(folder)
    names, lines = output_names(found)
    for line in [] if quiet else lines:
        print(line)
    done = {} if regrade else {s: g for s in found if (g := _already(out / names[s], key)) is not None}
    todo = [s for s in found if s not in done]
    args = (repeats, edition, limits, only, select)
    with tqdm(total=len(todo), desc="grading", unit="submission", disable=quiet or not todo) as bar:
        if executor == "inprocess":
            fresh = _in_process(todo, out, names, args, jobs, bar)
        else:
            fresh = _through_submitit(todo, out, names, args, jobs, bar, executor, partition, limits)
    for s, g in fresh.items():
        fresh[s] = replace(g, name=names[s])
        if not g.note:
            _sign(key, out / names[s])
    graded = [done.get(s) or fresh[s] for s in found]
    report.write_csv(out / "grades.csv", [(g.name, g.rows, g.note or summary.short_remarks(g)) for g in graded])
    summary.write(out, graded, summary.Batch(repeats, time.monotonic() - start, {name_of(s): s for s in found},
                                             len(done)))
    if not quiet:
        for g in graded:
            if g.note:
                print(f"{g.name:<40} {g.note}")
                continue
            earned = sum(r.points for r in g.rows if r.points is not None)
            possible = sum(r.possible for r in g.rows if r.points is not None)
            skipped = " (graded before; REGRADE=1 grades again)" if g in done.values() else ""
            print(f"{g.name:<40} {earned:6.1f}/{possible}  ({g.seconds:.0f} s){skipped}")
        print(f"written: {out / 'grades.csv'}, {out / 'summary.md'}, {out / 'summary.png'} and one folder per submission")
    return graded


def _graded_in_child(submission: Path, folder: Path, args: tuple, conn) -> None:
    """A child process's whole life: grade one submission, send the Graded (or the error) back.
    SIGTERM (the parent stopping) unwinds as SystemExit: its run stopped, its scratch removed."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    start = time.monotonic()
    try:
        result = grade_one(submission, folder, *args, self_check=False)  # the parent checked this machine
    except Exception as e:  # noqa: BLE001 - a row that says why, not a lost folder
        result = _died(submission, e, time.monotonic() - start)
    conn.send(result)
    conn.close()


def _in_process(todo: list[Path], out: Path, names: dict[Path, str], args: tuple, jobs: int,
                bar: tqdm) -> dict[Path, Graded]:
    """Each submission graded by a process of its own (spawned: it shares no descriptor, thread
    or memory with another submission's grading), at most ``jobs`` at once. A process that dies
    (killed, out of memory) costs its own submission a "not graded" row, never a neighbour's."""
    context = mp.get_context("spawn")
    results: dict[Path, Graded] = {}
    waiting, running = list(todo), {}
    try:
        while waiting or running:
            while waiting and len(running) < max(1, jobs):
                submission = waiting.pop(0)
                receive, send = context.Pipe(duplex=False)
                child = context.Process(target=_graded_in_child, name=f"grade {names[submission]}",
                                        args=(submission, out / names[submission], args, send))
                child.start()
                send.close()
                running[submission] = (child, receive, time.monotonic())
            ready = mp_connection.wait([r for _, r, _ in running.values()] + [c.sentinel for c, _, _ in running.values()])
            for submission, (child, receive, started) in list(running.items()):
                if receive not in ready and child.sentinel not in ready:
                    continue
                try:
                    results[submission] = receive.recv()
                except (EOFError, OSError):
                    child.join()
                    results[submission] = _died(submission, RuntimeError(
                        f"the grading process died (exit status {child.exitcode})"), time.monotonic() - started)
                child.join()
                receive.close()
                del running[submission]
                bar.update()
    finally:  # this process stopped (SIGTERM, Ctrl-C): so are the gradings it started
        for child, _, _ in running.values():
            child.terminate()
        for child, _, _ in running.values():
            child.join()
    return results


def _through_submitit(todo: list[Path], out: Path, names: dict[Path, str], args: tuple, jobs: int, bar: tqdm,
                      executor: str, partition: str | None, limits: Limits) -> dict[Path, Graded]:
    """One submitit job per submission, at most ``jobs`` running at once (SLURM: an array)."""
    import submitit

    logs = out / "jobs"
    shutil.rmtree(logs, ignore_errors=True)
    ex = submitit.AutoExecutor(folder=logs, cluster=executor)
    params = {"timeout_min": int(limits.submission_timeout_s // 60) + 10, "name": "grade"}
    if executor == "slurm":
        params.update(slurm_partition=partition, slurm_array_parallelism=max(1, jobs), cpus_per_task=2,
                      mem_gb=int(limits.memory_gb) + 8)
    ex.update_parameters(**params)
    results: dict[Path, Graded] = {}
    waiting, running = list(todo), []
    started = dict.fromkeys(todo, time.monotonic())
    if executor == "slurm":  # one array; SLURM keeps at most `jobs` of its tasks running
        with ex.batch():
            running = [(s, ex.submit(grade_one, s, out / names[s], *args)) for s in waiting]
        waiting = []
    while waiting or running:
        while waiting and len(running) < max(1, jobs):
            submission = waiting.pop(0)
            started[submission] = time.monotonic()
            running.append((submission, ex.submit(grade_one, submission, out / names[submission], *args)))
        for submission, job in [r for r in running if r[1].done()]:
            running.remove((submission, job))
            try:
                results[submission] = job.result()
            except Exception as e:  # noqa: BLE001 - the job died: its row says why
                results[submission] = _died(submission, e, time.monotonic() - started[submission])
            bar.update()
        time.sleep(0.5)
    return results
