"""Issue 51: ranks sealed by construction. Each class of the issue, rebuilt as a small hostile
fixture on the weak optimizer (every rank keeps the whole state: the answers' mutant
``full_optimizer_state``, honestly capped at 5 of 15), earns no more than that weak code's grade,
held or not; clean-up and the submission's declared packages.

* Storage: the state written after each step to the first writable place the rank finds (its
  home, TMPDIR, working folder, ``/tmp``, ``/dev/shm``), fsync'ed and dropped from the page cache,
  read back before the next step. No shared store folder is left (the group's store is rank 0's
  TCP store), and every writable place is a tmpfs charged to the rank's memory cgroup: the pages
  stay in the reading.
* A helper the rank forks whose main thread leaves (``pthread_exit``) while a second thread keeps
  the state and serves it over a socketpair: its memory lines are read from its threads, and its
  code's C calls and fork are witnessed as they run.
* State kept in a class attribute, which the in-rank count does not walk: the reading and the
  rank's own tensors disagree, a hold, and a held point test counts as not passed for the cap.
* A deep folder tree left behind is removed without recursion; a declared package is installed
  for the submission (from a course wheelhouse here), or the tests it breaks are held with its name.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from grading.harness import grade
from grading.isolation import sandbox, student
from grading.isolation.scrub import remove_tree
from grading.intake import packages
from tests.answers_fixture import PER_PARAMETER_FILE, ZERO_FILE, apply_edits
from tests.test_grading import PER_PARAMETER, QUICK, ZERO, make_submission, points, unpassed

pytestmark = pytest.mark.problem("beyond")

REPO = Path(__file__).resolve().parent.parent
WEAK_CAP = 5.0  # optimizer_state_sharding's cap: what the unsharded optimizer honestly earns at most
STEP = "        loss = self.local.step(closure, **kwargs)\n"

PARKED_ON_DISK = STEP.replace("        loss", "        _restore(self)\n        loss") + "        _park(self)\n"
PARK_ON_DISK = '''

def _park(opt):
    """The whole state to the first writable place, synced and dropped from the page cache."""
    import os
    params = list(opt.local.state)
    for folder in (os.environ.get("HOME"), os.environ.get("TMPDIR"), os.getcwd(), "/tmp", "/var/tmp", "/dev/shm"):
        try:
            path = os.path.join(folder, f"parked-{os.getpid()}.pt")
            torch.save([opt.local.state[p] for p in params], path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        except (OSError, TypeError):
            continue
        opt.local.state.clear()
        opt.parked = (path, params)
        return


def _restore(opt):
    import os
    if getattr(opt, "parked", None):
        path, params = opt.parked
        for p, s in zip(params, torch.load(path, weights_only=True)):
            opt.local.state[p] = s
        os.unlink(path)
        opt.parked = None
'''

PARK_IN_HELPER = '''

def _helper():
    """A forked helper whose main thread leaves while a second thread keeps what it is sent."""
    import ctypes, os, socket, threading
    mine, theirs = socket.socketpair()
    if os.fork() == 0:
        mine.close()

        def serve():
            kept = b""
            while True:
                head = theirs.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    os._exit(0)
                size = int.from_bytes(head, "little")
                if size == 0:
                    theirs.sendall(len(kept).to_bytes(8, "little") + kept)
                else:
                    kept = theirs.recv(size, socket.MSG_WAITALL)

        threading.Thread(target=serve).start()
        ctypes.CDLL(None).pthread_exit(None)
    theirs.close()
    return mine


def _park(opt):
    import io
    opt.helper = getattr(opt, "helper", None) or _helper()
    params = list(opt.local.state)
    buffer = io.BytesIO()
    torch.save([opt.local.state[p] for p in params], buffer)
    data = buffer.getvalue()
    opt.helper.sendall(len(data).to_bytes(8, "little") + data)
    opt.local.state.clear()
    opt.parked = params


def _restore(opt):
    import io, socket
    if getattr(opt, "parked", None):
        opt.helper.sendall((0).to_bytes(8, "little"))
        size = int.from_bytes(opt.helper.recv(8, socket.MSG_WAITALL), "little")
        kept = torch.load(io.BytesIO(opt.helper.recv(size, socket.MSG_WAITALL)), weights_only=True)
        for p, s in zip(opt.parked, kept):
            opt.local.state[p] = s
        opt.parked = None
'''

PARK_IN_CLASS = '''

def _park(opt):
    """The state where the in-rank count does not look: a class attribute."""
    type(opt).vault[id(opt)] = (list(opt.local.state), [opt.local.state[p] for p in opt.local.state])
    opt.local.state.clear()


def _restore(opt):
    params, states = type(opt).vault.pop(id(opt), ((), ()))
    for p, s in zip(params, states):
        opt.local.state[p] = s
'''


def weak_with(tmp_path: Path, name: str, helpers: str, class_line: str = "") -> Path:
    """The unsharded optimizer that parks its whole state between steps with ``helpers``."""
    tree = make_submission(tmp_path / name, "full_optimizer_state")
    edits = [(ZERO_FILE, STEP, PARKED_ON_DISK), (ZERO_FILE, "\n\nclass ShardedOptimizer", helpers + "\n\nclass ShardedOptimizer")]
    if class_line:
        edits.append((ZERO_FILE, "class ShardedOptimizer(torch.optim.Optimizer):\n",
                      "class ShardedOptimizer(torch.optim.Optimizer):\n" + class_line))
    return apply_edits(tree, name, edits)


POINT_TESTS = "test_state_is_sharded or test_every_rank_keeps_its_share"


@pytest.mark.parametrize("name,helpers,on_disk", [("helper", PARK_IN_HELPER, False), ("class_attribute", PARK_IN_CLASS, False),
                                                   ("storage_on_disk", PARK_ON_DISK, True)],
                         ids=["helper", "class_attribute", "storage_on_disk"])
def test_state_parked_out_of_sight_fails_or_holds_the_point_tests(tmp_path, name, helpers, on_disk):
    """A helper whose main thread left, a class attribute (the in-rank count walks the
    submission's classes since issue 51): the sharding test passes on neither (held, the reading
    and the rank's own tensors disagreeing, or failed), and the problem earns at most the weak
    code's capped 5.
    ``storage_on_disk``: graded as where a container refuses user namespaces (no tmpfs of the
    rank's own: its file is on disk and dropped from the page cache, in no memory reading); the
    files the ranks' uid holds are read with each rank's memory (outside.stored_on_disk), and the
    answers keep those points there."""
    tree = weak_with(tmp_path, name, helpers, "    vault: dict = {}\n" if name == "class_attribute" else "")
    if on_disk:
        graded = as_a_container(tree, tmp_path / "out")
        assert graded["points"][ZERO] <= WEAK_CAP and len(graded["outputs"]) == 3, graded["outputs"]
        honest = as_a_container(make_submission(tmp_path / "honest"), tmp_path / "out-honest")
        assert honest["points"] == {ZERO: 15.0}, honest["outputs"]  # the selected tests share the 15 points
        return
    graded = grade(tree, tmp_path / "out", 1, "2026", QUICK, quiet=True, only=(ZERO,), select=POINT_TESTS)
    sharded = [t for t in graded.tests if "test_state_is_sharded" in t.name]
    assert sharded and not any(t.passed for t in sharded) and points(graded, ZERO) <= WEAK_CAP, unpassed(graded)


def as_a_container(tree: Path, out: Path, problem: str = ZERO, select: str = POINT_TESTS) -> dict:
    """Graded as in Gradescope's container: as root, no namespaces, no user namespace for a rank's
    own storage (tests/fallback_grade.py, ``GRADING_PRIVATE_STORAGE=0``); its summary."""
    if not student.can_switch() or shutil.which("unshare") is None:
        pytest.skip("the container's mode needs root")
    args = {"submission": str(tree), "out": str(out), "edition": "2026", "only": [problem], "select": select,
            "test_timeout_s": QUICK.test_timeout_s, "submission_timeout_s": QUICK.submission_timeout_s}
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-m", "tests.fallback_grade",
                           json.dumps(args)], capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={**os.environ, sandbox.PRIVATE_STORAGE_ENV: "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])[tree.name]


def test_a_hold_on_a_point_test_caps_the_problem(tmp_path):
    """State written to the first writable place after each step (a tmpfs of the rank's own,
    charged to its memory: the reading sees it) while its optimizer holds none: the point tests
    are held, and a held point test counts as not passed, so the other 7 points are capped at 5,
    as the weak code's (until issue 51 a hold lifted the cap: 7 of 15); grade.md gives the total
    were the holds released."""
    out = tmp_path / "out"
    graded = grade(weak_with(tmp_path, "storage", PARK_ON_DISK), out, 1, "2026", QUICK, quiet=True, only=(ZERO,))
    held = [t for t in graded.tests if t.problem == ZERO and t.held]
    row = next(r for r in graded.rows if r.problem == ZERO)
    assert held and points(graded, ZERO) == pytest.approx(WEAK_CAP) and row.capped, unpassed(graded)
    assert row.held == pytest.approx(15 - WEAK_CAP), row
    assert "15.0 if a TA releases every hold" in (out / "grade.md").read_text()


def test_a_deep_tree_and_a_link_are_removed_without_recursion_or_following(tmp_path):
    """6000 folders deep (shutil.rmtree raised RecursionError, ignore_errors or not), a file at
    every thousandth, and a link to a folder outside that must survive."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("kept")
    top = tmp_path / "left"
    top.mkdir()
    os.symlink(outside, top / "link")
    fd = os.open(top, os.O_RDONLY)
    for depth in range(6000):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
        if depth % 1000 == 0:
            os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.close(fd)
    assert remove_tree(str(top)) and not top.exists()
    assert (outside / "keep").read_text() == "kept"


LEFTOVERS = '''
def _leave_a_mess():
    """A 3000-deep tree in the working folder and the home, and a home filled to its bound."""
    import os
    for base in (os.getcwd(), os.environ.get("HOME", "/tmp")):
        try:
            fd = os.open(base, os.O_RDONLY)
            for _ in range(3000):
                os.mkdir("deep", dir_fd=fd)
                inner = os.open("deep", os.O_RDONLY, dir_fd=fd)
                os.close(fd)
                fd = inner
            os.close(fd)
        except OSError:
            pass
    try:
        with open(os.path.join(os.environ.get("HOME", "/tmp"), "filler"), "wb") as f:
            for _ in range(1024):
                f.write(b"x" * (1 << 20))
    except OSError:
        pass


_leave_a_mess()
'''


PROBE = "sealed-dep-probe"


def wheelhouse(folder: Path) -> Path:
    """A folder holding one pure-Python wheel, ``sealed-dep-probe`` 1.0 (its module returns
    what it is given), made here: the course's wheelhouse, no network needed."""
    folder.mkdir()
    files = {"sealed_dep_probe/__init__.py": b"def checked(value):\n    return value\n",
             "sealed_dep_probe-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: sealed-dep-probe\nVersion: 1.0\n",
             "sealed_dep_probe-1.0.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for name, data in files.items()) + "sealed_dep_probe-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / "sealed_dep_probe-1.0-py3-none-any.whl", "w") as wheel:
        for name, data in {**files, "sealed_dep_probe-1.0.dist-info/RECORD": record.encode()}.items():
            wheel.writestr(name, data)
    return folder


def declaring(tmp_path: Path) -> Path:
    """The answers whose DDP imports a package its pyproject.toml declares (pinned by its uv.lock)."""
    tree = make_submission(tmp_path / "declaring")
    (tree / "pyproject.toml").write_text(f'[project]\nname = "student"\nversion = "0.1"\ndependencies = ["torch", "{PROBE}"]\n')
    (tree / "uv.lock").write_text(f'version = 1\n\n[[package]]\nname = "{PROBE}"\nversion = "1.0"\n')
    return apply_edits(tree, "declaring", [(PER_PARAMETER_FILE, "\nimport torch\n",
                                            "\nimport sealed_dep_probe  # noqa: F401\nimport torch\n")])


def full(graded, problem: str) -> float:
    return sum(t.max_score for t in graded.tests if t.problem == problem and not t.beyond)


def test_after_a_mess_a_declared_package_is_installed_or_held_with_its_name(tmp_path, monkeypatch):
    """Three gradings by one process. A submission that leaves a deep tree in its working folder
    and its home, and fills its home to its bound, in every rank of every test; then the next
    submission, whose DDP imports a package its pyproject.toml declares and this environment
    lacks, is graded as if alone: the package installed from the course's wheelhouse, every
    point. With an empty wheelhouse its tests are held, the package named, never zeroed."""
    select = "test_matches_single_process"
    messy = make_submission(tmp_path / "messy")
    adapters = messy / "tests" / "adapters.py"
    adapters.write_text(adapters.read_text() + LEFTOVERS)
    first = grade(messy, tmp_path / "out-messy", 1, "2025", QUICK, quiet=True, only=(PER_PARAMETER,), select=select)
    assert points(first, PER_PARAMETER) == full(first, PER_PARAMETER), unpassed(first)

    tree = declaring(tmp_path)
    assert packages.missing(tree, []) == [f"{PROBE}==1.0"]
    monkeypatch.setenv(packages.WHEELHOUSE_ENV, str(wheelhouse(tmp_path / "wheels")))
    installed = grade(tree, tmp_path / "out-installed", 1, "2025", QUICK, quiet=True, only=(PER_PARAMETER,),
                      select=select)
    assert points(installed, PER_PARAMETER) == full(installed, PER_PARAMETER), unpassed(installed)
    text = (tmp_path / "out-installed" / "grade.md").read_text()
    assert f"Installed for this submission (declared in its pyproject.toml, not in the grader's environment): " \
           f"{PROBE}==1.0" in text
    assert text.splitlines()[2].startswith("Guarantees on this grader: "), text[:400]

    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv(packages.WHEELHOUSE_ENV, str(empty))
    unavailable = grade(tree, tmp_path / "out-held", 1, "2025", QUICK, quiet=True, only=(PER_PARAMETER,), select=select)
    tests = [t for t in unavailable.tests if t.problem == PER_PARAMETER and not t.beyond]
    assert tests and all(t.held and f"needs package {PROBE}, declared in pyproject.toml" in t.output for t in tests), \
        unpassed(unavailable)
    assert f"Needs package {PROBE}, declared in pyproject.toml" in (tmp_path / "out-held" / "grade.md").read_text()


def test_what_this_grader_lacks_is_held_and_a_local_source_is_never_looked_up(tmp_path):
    """Real students (issue 51): a Triton self-test at import on a grader without a GPU, a name
    from a newer Python's standard library, and an import error where the submission declares a
    Python this grader does not run are held, not zeroed; a wrong answer is not. A dependency
    with a source of its own (the course's cs336-basics by path) is never looked up in an index."""
    gpu = "rank 1: cs336_systems/flashattention.py:350: RuntimeError: 0 active drivers ([]). There should only be one."
    newer = "rank 0: cs336_systems/opt.py:4: ImportError: cannot import name 'override' from 'typing' (typing.py)"
    elsewhere = "rank 0: cs336_systems/opt.py:9: ImportError: cannot import name 'thing' from 'helpers'"
    assert packages.hold_unrunnable(gpu, None).startswith("held for review: it needs a GPU")
    assert packages.hold_unrunnable(newer, None).startswith("held for review: it imports from the standard library's typing")
    assert packages.hold_unrunnable(elsewhere, None) == elsewhere
    assert "declares Python >=3.99" in packages.hold_unrunnable(elsewhere, ">=3.99")
    wrong = "rank 0: parameter w after step 1 of 3 differs from single-process training by 0.3"
    assert packages.hold_unrunnable(wrong, ">=3.99") == wrong
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "a2"\nversion = "1"\nrequires-python = ">=3.99"\n'
                                             'dependencies = ["cs336-basics", "own-thing", "rich"]\n'
                                             '[tool.uv.sources]\nown-thing = { path = "./own" }\n')
    assert sorted(packages.declared(tmp_path, [])) == ["rich"]
    assert packages.python_needed(tmp_path) == ">=3.99"
