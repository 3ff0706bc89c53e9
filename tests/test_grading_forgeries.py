"""Submissions that try to forge their grade, each graded as the code underneath deserves.

Each is the answers' submission with the public stub's adapters (worth 0) or a wrong solution
(worth what it earns without the forgery), plus one trick: a patched comparison, a ``pytest.py`` or ``sitecustomize.py`` at its
root that writes "passed" outcomes, a rank that hunts for the outcomes channel under ``/proc``,
a rank that exits early with status 0, a rank that kills its parent. The grader decides in
processes that never import the submission and reads outcomes from a pipe no rank holds, so
none of them may move a point. Tricks that reach for other processes run only where the
grader has its own PID namespace (here, no process outside it can be reached).
"""

from __future__ import annotations

import pytest

from grading.harness import grade, namespaces_available
from tests.test_grading import MATCHES, PER_PARAMETER, QUICK, ZERO, failures, make_submission, points

pytestmark = pytest.mark.problem("beyond")

# Writes forged "passed" outcomes wherever an outcomes channel could be: every descriptor this
# process holds, any path or descriptor named by a --grading-* flag on a command line under
# /proc, and every descriptor of every process it can open there.
FORGE = '''
import json as _json, os as _os


def _forge():
    line = (_json.dumps({"test": "test_sharded_optimizer.py::test_sgd_with_momentum",
                         "problem": "optimizer_state_sharding", "passed": True, "skipped": False,
                         "reason": "", "seconds": 0.0}) + "\\n").encode()
    for fd in range(3, 64):
        try:
            _os.write(fd, line)
        except OSError:
            pass
    for pid in filter(str.isdigit, _os.listdir("/proc")):
        targets = []
        try:
            for arg in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\\0"):
                if arg.startswith("--grading-"):
                    value = arg.split("=", 1)[-1]
                    targets += [value, f"/proc/{pid}/fd/{value}"]
            targets += [f"/proc/{pid}/fd/{fd}" for fd in _os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            pass
        for target in targets:
            try:
                with open(target, "ab") as f:
                    f.write(line)
            except OSError:
                pass
'''

# Tries to write the grader's copy of its own code, this repository (named in the rank's
# environment) and a file beside the scratch folder, then fails with what it managed.
TAMPER = '''
import os as _os, sys as _sys
_wrote = []
for _path in [_os.path.join(_os.path.dirname(_sys.modules["grading"].__file__), "report.py"),
              _os.path.join(_os.environ.get("GRADING_HIDE", "/nonexistent"), "grading", "tampered.py"), {canary!r}]:
    try:
        with open(_path, "a") as _f:
            _f.write("# tampered\\n")
        _wrote.append(_path)
    except OSError:
        pass
raise RuntimeError("tamper: wrote " + (", ".join(_wrote) or "nothing"))
'''

ALLCLOSE = "import torch\ntorch.allclose = lambda *a, **k: True\ntorch.equal = lambda *a, **k: True\n"


def with_forgery(tmp_path, trick: str, mutant: str | None = None):
    tree = make_submission(tmp_path, mutant, stub=mutant is None)
    adapters = tree / "tests" / "adapters.py"
    if trick == "allclose":
        adapters.write_text(ALLCLOSE + adapters.read_text())
    elif trick == "pytest_py":
        (tree / "pytest.py").write_text(FORGE + "\n_forge()\n")
        (tree / "tests" / "conftest.py").write_text("import pytest\n")
    elif trick == "sitecustomize":
        (tree / "sitecustomize.py").write_text(FORGE + "\nimport atexit\n_forge()\natexit.register(_forge)\n")
        (tree / "usercustomize.py").write_text("import sitecustomize\n")
    elif trick == "proc":
        adapters.write_text(FORGE + "\n_forge()\n" + adapters.read_text())
    elif trick in ("sys_exit", "os_exit"):
        call = "import sys; sys.exit(0)" if trick == "sys_exit" else "import os; os._exit(0)"
        adapters.write_text(adapters.read_text().replace("    raise NotImplementedError", f"    {call}"))
    elif trick == "tamper":
        adapters.write_text(TAMPER.format(canary=str(tmp_path / "canary.txt")) + adapters.read_text())
    elif trick == "kill_parent":
        adapters.write_text("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                            "try:\n    os.kill(1, signal.SIGKILL)\nexcept OSError:\n    pass\n" + adapters.read_text())
    return tree


@pytest.mark.parametrize("trick, reason", [
    ("pytest_py", "NotImplementedError"),
    ("sitecustomize", "NotImplementedError"),
    ("proc", ""),  # its own report pipe, written over, is unreadable; or the stub's error
    ("sys_exit", "the submission called sys.exit(0)"),
    ("os_exit", "exited (code 0) before reporting its results"),
    ("kill_parent", ""),
])
def test_a_forged_stub_scores_zero(tmp_path, trick, reason):
    if trick in ("proc", "kill_parent") and not namespaces_available():
        pytest.skip("reaches for other processes: run only where the grader has its own PID namespace")
    graded = grade(with_forgery(tmp_path, trick), tmp_path / "out", 1, "2025", QUICK, quiet=True,
                   only=(ZERO,), select="test_sgd_with_momentum or test_state_is_sharded")
    assert points(graded, ZERO) == 0, [t.output for t in graded.tests]
    assert all(t.runs == 1 for t in graded.tests), "a forged outcome reached the harness"
    assert all(reason in line for line in failures(graded, ZERO)), failures(graded, ZERO)
    assert not any("timed out" in t.output for t in graded.tests)  # no trick costs a timeout
    assert graded.seconds < QUICK.submission_timeout_s


def test_a_patched_comparison_earns_what_the_wrong_solution_earns(tmp_path):
    """Sums instead of averages, with torch.allclose and torch.equal patched to always agree in
    the adapters: the comparison runs in the grader, where nothing was patched."""
    graded = grade(with_forgery(tmp_path, "allclose", "sums"), tmp_path / "out", 1, "2025", QUICK, quiet=True,
                   only=(PER_PARAMETER,), select=MATCHES)
    assert points(graded, PER_PARAMETER) == 0
    assert all("differs from single-process training" in line for line in failures(graded, PER_PARAMETER))


def test_ranks_write_no_file_of_the_grader_or_this_repository(tmp_path):
    if not namespaces_available():
        pytest.skip("read-only file systems come with the mount namespace")
    (tmp_path / "canary.txt").write_text("")
    graded = grade(with_forgery(tmp_path, "tamper"), tmp_path / "out", 1, "2025", QUICK, quiet=True,
                   only=(ZERO,), select="test_sgd_with_momentum")
    assert points(graded, ZERO) == 0
    assert all("tamper: wrote nothing" in line for line in failures(graded, ZERO)), failures(graded, ZERO)
    assert (tmp_path / "canary.txt").read_text() == ""


def test_reports_are_data_never_code():
    """What a rank sends decodes to plain values and fresh tensors, or is refused whole."""
    import pickle

    import torch

    from grading.isolation import wire

    sent = {"scalar": torch.tensor(1.5), "view": torch.randn(3, 2).t(), "half": torch.ones(2, dtype=torch.bfloat16),
            "plain": [1, "x", None, True], "empty": torch.empty(0, 3)}
    got = wire.decode(wire.encode(sent))
    assert got["plain"] == sent["plain"] and all(torch.equal(got[k], sent[k]) for k in ("scalar", "view", "half", "empty"))
    whole = wire.encode(sent)
    for forged in (b"", whole[:-3], whole + b"x", pickle.dumps(sent), b"\x05" + b"\x00" * 7 + b"{}"):
        with pytest.raises(wire.WireError):
            wire.decode(forged)
