"""Submissions graded at once cost each other nothing: a CPU share and a task limit per run, its
processes killed whatever session they fled to; a run whose every test fails the same way stops
early; an interrupted grader writes no grade.

The cgroup tests need a writable cgroup hierarchy (root on this machine, or a delegated one) and
are skipped where ``share.make`` cannot make one; the rule tests need nothing. Each takes well
under a second.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from grading.isolation import share
from grading.reports.outcomes import Outcomes, failure_key, same_slow_failure

pytestmark = pytest.mark.problem("beyond")

# A submission's trick (issue 38): busy loops, each in a session of its own, left running.
BUSY_IN_NEW_SESSIONS = """
import os, sys, time
for _ in range(3):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            while True:
                pass
        os._exit(0)
print("started", flush=True)
time.sleep(60)
"""


@pytest.fixture
def run_share():
    made = share.make(uuid.uuid4().hex)
    if not made.folders:
        pytest.skip("no writable cgroup here: the run gets resource limits alone (share.describe says so)")
    yield made
    made.kill_all()
    made.remove()


def test_busy_loops_in_new_sessions_stay_in_the_runs_share_and_die_with_it(run_share):
    proc = subprocess.Popen([sys.executable, "-c", BUSY_IN_NEW_SESSIONS], stdout=subprocess.PIPE,
                            preexec_fn=run_share.enter, start_new_session=True)
    assert proc.stdout.readline().strip() == b"started"
    inside = run_share.pids()
    assert len(inside) >= 4  # the script and its three loops, whatever their session
    sessions = {os.getsid(pid) for pid in inside if os.path.exists(f"/proc/{pid}")}
    assert len(sessions) >= 2
    for folder in run_share.folders:
        weight = folder / ("cpu.weight" if run_share.kind == "cgroup v2" else "cpu.shares")
        if weight.exists():
            assert int(weight.read_text()) in (share.V1_SHARES, share.V2_WEIGHT)
        if (folder / "pids.max").exists():
            assert int((folder / "pids.max").read_text()) == share.MAX_TASKS
    assert run_share.kill_all(timeout_s=10)
    proc.wait(timeout=10)
    time.sleep(0.1)
    assert not [pid for pid in inside if os.path.exists(f"/proc/{pid}") and
                open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z"]
    run_share.remove()
    assert not any(folder.exists() for folder in run_share.folders)


def test_a_runs_task_limit_stops_a_fork_bomb_in_it(run_share):
    for folder in run_share.folders:
        if (folder / "pids.max").exists():
            (folder / "pids.max").write_text("8")
    bomb = ("import os, time\nn = 0\ntry:\n    while n < 50:\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\n"
            "print(n, flush=True)\ntime.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", bomb], preexec_fn=run_share.enter, stdout=subprocess.PIPE)
    assert int(proc.stdout.readline()) < 8  # the script itself and its children: 8 tasks at most
    assert run_share.kill_all(timeout_s=10)
    proc.wait(timeout=10)


def run(test: str, problem: str, reason: str, seconds: float, passed: bool = False) -> dict:
    return {"test": test, "problem": problem, "passed": passed, "skipped": False, "reason": reason, "seconds": seconds}


ESCAPE = "rank {}: RuntimeError: Connection refused after {} s"


def test_the_same_slow_failure_everywhere_stops_the_run():
    runs = [run("a::t1", "ddp", ESCAPE.format(0, 59), 58), run("a::t2", "ddp", ESCAPE.format(1, 58), 59)]
    assert same_slow_failure(runs, 60) is None  # two tests of one problem: not yet
    runs.append(run("b::t1", "fsdp", ESCAPE.format(0, 57), 57))
    assert same_slow_failure(runs, 60) == ESCAPE.format(0, 59)
    assert failure_key(ESCAPE.format(0, 59)) == failure_key(ESCAPE.format(2, 1))


@pytest.mark.parametrize("change", ["fast", "different", "one passed", "one problem"])
def test_a_failure_that_differs_or_comes_fast_never_stops_a_run(change):
    runs = [run("a::t1", "ddp", ESCAPE.format(0, 59), 58), run("a::t2", "ddp", ESCAPE.format(0, 59), 58),
            run("b::t1", "fsdp", ESCAPE.format(0, 59), 58), run("b::t2", "fsdp", ESCAPE.format(0, 59), 58)]
    if change == "fast":
        runs[2]["seconds"] = 3
    elif change == "different":
        runs[3]["reason"] = "rank 0: AssertionError: gradients differ"
    elif change == "one passed":
        runs[1].update(passed=True, reason="")
    else:
        for r in runs:
            r["problem"] = "ddp"
    assert same_slow_failure(runs, 60) is None


def test_outcomes_stop_once_the_rule_holds_and_count_what_never_ran():
    reader, writer = os.pipe()
    outcomes = Outcomes(reader, test_timeout_s=60)
    lines = [{"collected": f"{p}::t{i}", "problem": p} for p in ("ddp", "fsdp") for i in range(3)]
    lines += [run(f"{p}::t{i}", p, ESCAPE.format(0, 59), 58) for p, i in (("ddp", 0), ("ddp", 1), ("fsdp", 0))]
    os.write(writer, b"".join(f"{__import__('json').dumps(x)}\n".encode() for x in lines) + b"not json\n")
    os.close(writer)
    assert outcomes.stop.wait(timeout=10)
    outcomes.join(timeout=10)
    assert outcomes.stop_reason == ESCAPE.format(0, 59)
    assert outcomes.missing_runs(repeats=2) == 6 * 2 - 3


def test_clean_up_scans_every_shared_folder_whatever_the_uid_left_in_one(tmp_path, monkeypatch):
    from grading.isolation import student

    if not student.can_switch():
        pytest.skip("files of another uid can be made by root only")
    uid = student.FIRST_UID + 7
    lock, shm, tmp = (tmp_path / n for n in ("lock", "shm", "tmp"))
    for folder in (lock, shm, tmp, tmp / "shared"):
        folder.mkdir()
        os.chmod(folder, 0o1777)
    monkeypatch.setattr(student, "SHARED_FOLDERS", tuple(map(str, (lock, shm, tmp))))
    monkeypatch.setattr(student, "MAX_ENTRIES", 50)
    theirs = [lock / f"f{i}" for i in range(2000)] + [shm / "big", tmp / "shared" / "deep"]
    for path in theirs:
        path.write_bytes(b"")
        os.chown(path, uid, uid)
    for i in range(60):  # another user's files: they alone spend a folder's budget
        (lock / f"other{i}").write_bytes(b"")
    removed = student.remove_files(uid)
    assert len(removed) == len(theirs) and not [p for p in theirs if os.path.lexists(p)]
    assert (lock / "other0").exists()


def test_a_killed_graders_empty_cgroup_is_removed_and_a_live_ones_kept(run_share):
    parent = run_share.folders[0].parent
    dead = parent / "grading-999999999-deadbeef"  # no such pid
    dead.mkdir()
    made = share.make(uuid.uuid4().hex)
    try:
        assert not dead.exists() and all(f.exists() for f in run_share.folders)
    finally:
        if dead.exists():
            dead.rmdir()
        made.remove()
