"""Issue 46's hostile classes: storage that outlives a test or is shared between ranks, and
readings a rank could make lie, each graded as its code deserves.

* Averaging through files: asynchronous all-reduces of zeros as large as the gradients during
  backward (the loopback carries exactly the bytes of an honest overlap), the real average
  through files in ``$HOME``. Each rank's home is its own (sandbox.private_storage): the peer's
  file is not there, and the problem's tests fail on the exception.
* System V shared memory: a segment made in a rank (no process owns it) is gone after grading.
* A source that reaches for what can make an outside reading lie (here ``ctypes``): the memory
  checks it would pass are held for review, neither passed nor capped.
* Not a forgery: gradients all-reduced in chunks smaller than a bucket (a real student's) keep
  the overlap points: each message's headers are counted from outside.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from grading.readings import review
from grading.isolation import scrub
from grading.harness import grade
from tests.answers_fixture import BUCKETED_FILE, PER_PARAMETER_FILE
from tests.test_grading import BUCKETED, PER_PARAMETER, QUICK, ZERO, failures, points
from tests.test_grading_probe_forgeries import forged

pytestmark = pytest.mark.problem("beyond")

ZEROS_THEN_FILES = [
    (PER_PARAMETER_FILE, "self.handles.append(dist.all_reduce(param.grad, async_op=True))",
     "self.handles.append(dist.all_reduce(torch.zeros_like(param.grad), async_op=True))"),
    (PER_PARAMETER_FILE, "        for handle in self.handles:\n            handle.wait()\n        self.handles.clear()\n",
     "        for handle in self.handles:\n            handle.wait()\n        self.handles.clear()\n"
     "        import os\n"
     "        home, rank = os.environ.get('HOME', '/tmp'), dist.get_rank()\n"
     "        grads = [p.grad for p in self.module.parameters() if p.grad is not None]\n"
     "        self.step_count = getattr(self, 'step_count', 0) + 1\n"
     "        torch.save(grads, f'{home}/g{self.step_count}-{rank}.pt')\n"
     "        dist.barrier()\n"
     "        for other in range(self.world_size):\n"
     "            if other != rank:\n"
     "                for mine, theirs in zip(grads, torch.load(f'{home}/g{self.step_count}-{other}.pt', weights_only=True)):\n"
     "                    mine.add_(theirs)\n"),
]

SHM_KEY = 0x5EED0046
SYSV_SEGMENT = f'''
import ctypes as _ctypes

_libc = _ctypes.CDLL(None, use_errno=True)
_libc.shmat.restype = _ctypes.c_void_p


def _park():
    """A 32 MiB System V segment, touched: owned by no process once the rank is gone."""
    ident = _libc.shmget({SHM_KEY} + __import__("os").getpid(), 32 << 20, 0o1000 | 0o600)
    if ident >= 0:
        address = _libc.shmat(ident, None, 0)
        _ctypes.memset(address, 1, 32 << 20)
'''


def test_averaging_through_files_in_home_fails(tmp_path):
    tree = forged(tmp_path, ZEROS_THEN_FILES)
    graded = grade(tree, tmp_path / "out", 1, "2025", QUICK, quiet=True, only=(PER_PARAMETER,),
                   select="test_matches_single_process")
    assert points(graded, PER_PARAMETER) == 0, failures(graded, PER_PARAMETER)
    assert any("No such file" in line or "FileNotFoundError" in line for line in failures(graded, PER_PARAMETER))


def test_a_segment_parked_through_ctypes_is_held_for_review_and_gone_after(tmp_path):
    """A rank parks 32 MiB in a System V segment through ctypes (no process owns it once the rank
    is gone): no segment outlives the grading, and the source's ``ctypes`` holds the memory
    check it would pass for review, neither passed nor capped."""
    tree = forged(tmp_path)
    adapters = tree / "tests" / "adapters.py"
    adapters.write_text(adapters.read_text().replace(
        "def get_sharded_optimizer(*args, **kwargs):\n", SYSV_SEGMENT + "\n\ndef get_sharded_optimizer(*args, **kwargs):\n"
        "    _park()\n"))
    before = {ident for ident, _ in scrub.ipc_objects("shm")}
    out = tmp_path / "out"
    graded = grade(tree, out, 1, "2026", QUICK, quiet=True, only=(ZERO,),
                   select="test_state_is_sharded or test_sgd_with_momentum")
    assert {ident for ident, _ in scrub.ipc_objects("shm")} <= before
    held = [t for t in graded.tests if t.held]
    assert held and all(review.is_held(t.reason) and "tests/adapters.py:" in t.reason and "calls into C" in t.reason for t in held), \
        [t.output for t in graded.tests]
    row = next(r for r in graded.rows if r.problem == ZERO)
    assert row.held == pytest.approx(sum(t.max_score for t in held)) and not row.capped
    assert row.points > 0
    assert row.points == pytest.approx(sum(t.max_score for t in graded.tests if t.problem == ZERO and t.passed))
    assert "## Held for review" in (out / "grade.md").read_text()

CHUNKED = [(BUCKETED_FILE, "            self.in_flight[i] = (flat, dist.all_reduce(flat, async_op=True))",
            "            works = [dist.all_reduce(c, async_op=True) for c in flat.split(1024)]  # 4 KB messages\n"
            "            self.in_flight[i] = (flat, type('Works', (), {'wait': lambda _, ws=works: [w.wait() for w in ws]})())")]


def test_gradients_sent_in_chunks_smaller_than_a_bucket_keep_the_overlap_points(tmp_path):
    """A real student's bucketed DDP all-reduces each bucket in small chunks, each once and
    asynchronously during backward: each message's headers are counted from outside (the
    loopback's packets, against the grader's own all-reduces of one float), not read as
    gradients sent twice."""
    graded = grade(forged(tmp_path, CHUNKED), tmp_path / "out", 1, "2025", QUICK, quiet=True, only=(BUCKETED,),
                   select="test_communicates_during_backward or test_matches_single_process")
    assert points(graded, BUCKETED) == pytest.approx(sum(t.max_score for t in graded.tests if t.problem == BUCKETED)), \
        failures(graded, BUCKETED)


STUDENT_FILE = '''import ast
import ctypes
import mmap
import subprocess
import types

import numpy  # a library that loads C code at import: the library's, not the student's

TAG = "#"; KIND = ctypes.c_int  # a '#' in a string hides nothing, and names nothing that runs
VERSION = subprocess.run(["true"]).returncode  # a process at import, before the readings start


def unused():
    return ctypes.CDLL(None).getpid(), mmap.mmap(-1, 4096)


def _hidden():
    return ctypes.CDLL(None).getpid()


hidden = types.FunctionType(_hidden.__code__.replace(co_filename="<string>"), globals())


def used():
    exec("x = 1")
    ctypes.CDLL(None).getpid()
    hidden()
    compile(ast.parse("y = 2"), "<ast>", "exec")
    return mmap.mmap(-1, 4096)
'''


def test_the_audit_hook_witnesses_what_runs_in_the_submissions_own_lines(tmp_path):
    """In a fresh interpreter (a hook cannot be removed): lines that never run, what the import
    does (a library's C calls, the import system's compiles, a process for a version string)
    say nothing; once armed, the submission's own exec, C call, C call from code renamed
    ``<string>`` (named at the line that runs it), compile of a syntax tree and memory map, as
    they run, each say their line once."""
    import subprocess
    import sys

    (tmp_path / "student.py").write_text(STUDENT_FILE)
    script = ("import sys\nfrom grading.readings import review\nseen = []\n"
              f"arm = review.witness(seen.append, [{str(tmp_path)!r}])\nsys.path.append({str(tmp_path)!r})\n"
              "import student\nprint(len(seen))\narm()\nstudent.used()\nstudent.used()\nprint(seen)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(review.__file__).parents[2])
    assert out.returncode == 0, out.stderr
    at_import, lines = out.stdout.splitlines()
    assert at_import == "0", out.stdout
    c = "calls into C (ctypes): memory and pages the readings cannot attribute"
    assert [w["witness"] for w in eval(lines)] == [
        "student.py:25: compiles code from a string (exec/eval/compile)", f"student.py:26: {c}", f"student.py:27: {c}",
        "student.py:28: compiles code from a string (exec/eval/compile)",
        "student.py:29: maps memory (mmap): state kept in a file's or a shared segment's pages"]
