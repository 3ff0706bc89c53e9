"""Everything the harness learns from a submission's files, learnt in a limited subprocess.

Unpacking (files.py), finding the adapters, the edition, the import folders and the packages
missing all read what a submission wrote; they run in ``python -m grading.intake.intake``, a process of
its own under the submission's limits (address space, CPU time, file size, its remaining wall
time; it dies with the harness), which prints one JSON line (``Intake``) and nothing else the
harness trusts. Whatever a tree does to that process (a parser's worst case, a huge file), the
harness that records grades carries on and says why in the grade.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grading.isolation.containment import limit
from grading.problems import EDITION_ADAPTERS

INTAKE_MEMORY_GB = 2.0  # the unpack and the parsers need far less; a submission's limit may be lower
PR_SET_PDEATHSIG = 1


@dataclass
class Intake:
    """What the harness needs to grade a tree, as found in the scratch copy."""

    root: str  # the folder holding the adapters (the tree itself when there are none)
    detected: str  # the edition the adapters answer ("2026" when undecided: detect_edition)
    answers: str | None = None  # the edition more of whose own constructors it implements; None on a tie
    adapters: str | None = None
    problem: str = ""  # why nothing can be graded (no adapters, a syntax error, could not unpack)
    roots: list[str] = field(default_factory=list)
    remarks: list[str] = field(default_factory=list)  # grade.md's lines: packages missing, paths refused
    dropped: list[str] = field(default_factory=list)  # links and special files left out of the copy
    to_install: list[str] = field(default_factory=list)  # declared packages this Python lacks (packages.py)
    preload: list[str] = field(default_factory=list)  # libraries its files import: the fork server's (packages.py)
    unresolved: list[str] = field(default_factory=list)  # names its files import that nothing here provides
    python: str | None = None  # its requires-python, where it excludes the grader's Python
    own: list[list[str]] = field(default_factory=list)  # its own projects, [name, version]: packages.own_projects

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Intake:
        return cls(**json.loads(text))


def inspect(submission: Path, tree: Path, edition: str | None) -> Intake:
    """Unpack ``submission`` into ``tree`` and read what grading it needs (in this process)."""
    from grading.intake.files import unpack
    from grading.intake import packages
    from grading.intake.submission import (adapters_file, detect_edition, find_root, implemented_adapters,
                                           missing_packages, project_folders, python_roots, syntax_error)

    try:
        dropped = unpack(submission, tree)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        return Intake(str(tree), edition or "2026", problem=f"could not unpack the submission: {e}")
    root = find_root(tree)
    detected = detect_edition(root)
    adapters = adapters_file(root) if tree.exists() else None
    found = Intake(str(root), detected, adapters=str(adapters) if adapters else None,
                   dropped=dropped[:20])
    if adapters is None:
        found.problem = "no adapters file (tests/adapters.py or adapters.py) in the submission"
        return found
    _, implemented = implemented_adapters(adapters)
    # Each edition's own constructors (get_*: a hook may rightly be empty), as a fraction: the lists differ.
    own = {e: {n for n in names if n.startswith("get_")} - {n for o, theirs in EDITION_ADAPTERS.items() if o != e
                                                            for n in theirs} for e, names in EDITION_ADAPTERS.items()}
    done = {e: len(implemented & names) / max(1, len(names)) for e, names in own.items()}
    if len(set(done.values())) > 1:
        found.answers = max(done, key=done.get)
    if error := syntax_error(adapters, root):
        found.problem = error
        return found
    remarks: list[str] = []
    found.roots = [str(r) for r in python_roots(root, remarks)]
    found.remarks = remarks + missing_packages(root, adapters, edition or detected)
    found.to_install = packages.missing(root, project_folders(root))
    found.own = [list(p) for p in packages.own_projects(root, project_folders(root))]
    found.preload, found.unresolved = packages.libraries([Path(r) for r in found.roots] or [root])
    found.python = packages.python_needed(root)
    if found.python:
        found.remarks.append(f"It declares Python {found.python} (requires-python); this grader runs "
                             f"{packages.platform_version()}: tests that fail on an import or syntax error are held "
                             "for review.")
    if dropped:
        shown = ", ".join(dropped[:5]) + (f" and {len(dropped) - 5} more" if len(dropped) > 5 else "")
        found.remarks.append(f"Links and special files are not graded (left out of the copy): {shown}.")
    return found


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def run(submission: Path, tree: Path, edition: str | None, memory_gb: float, deadline: float) -> Intake:
    """``inspect`` in a subprocess under the submission's limits; a run that dies or overruns
    its time gives an Intake whose ``problem`` says so (and ``tree`` is left for the caller to
    remove with the rest of its scratch folder)."""
    seconds = max(1.0, deadline - time.monotonic())
    memory = min(memory_gb, INTAKE_MEMORY_GB)
    apply = limit(memory, int(seconds) + 1, 256)

    def preexec() -> None:
        apply()
        _die_with_parent()

    command = [sys.executable, "-m", "grading.intake.intake", str(submission), str(tree), edition or ""]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PYTHONSAFEPATH": "1",
           "PYTHONNOUSERSITE": "1"}
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, start_new_session=True, preexec_fn=preexec)
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return Intake(str(tree), edition or "2026",
                      problem=f"could not unpack the submission: reading it took more than {seconds:.0f} s")
    lines = out.decode(errors="replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        why = (err.decode(errors="replace").strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        if proc.returncode < 0:
            why = f"killed by {signal.Signals(-proc.returncode).name} (limits: {memory:g} GB, {seconds:.0f} s)"
        return Intake(str(tree), edition or "2026", problem=f"could not unpack the submission: {why[:200]}")
    return Intake.from_json(lines[-1])


if __name__ == "__main__":
    submission_arg, tree_arg, edition_arg = sys.argv[1:4]
    print(inspect(Path(submission_arg), Path(tree_arg), edition_arg or None).to_json(), flush=True)
