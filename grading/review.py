"""Held for review: where the grader's witnesses disagree, a TA decides, with both in front of them.

A check that reads a rank from outside (its memory, its loopback bytes) has more than one
witness: the reading itself; the rank's own tensors, counted inside it; whether the rank's memory
fell below what it held once imported; the tensors its modules hold once imported; and what its
source reaches for (``reaches``: C calls, memory maps, shared memory, the collector's freeze,
signal handlers, code run from strings). A false cap hits an honest student silently, while a
forgery needs deliberate work a TA recognises in the code; so where the witnesses disagree the
check neither caps nor passes. It fails with a reason that starts with ``HELD``: the test scores
nothing until a TA looks, the problem's cap does not apply (report.py), and grade.md, grades.csv
and the staff summary list it with both readings.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

HELD = "held for review: "
SOURCES_ENV = "GRADING_REACHES"  # the harness's scan of the submission (intake.py), as JSON
MAX_FILES = 2000  # .py files scanned at most; a tree with more is held on that alone
MAX_HITS = 12

# What a rank could use to make an outside reading lie, or to hide that it does; each with what a
# TA looks for. Matched in code, not in comments (a line's text before a "#").
SUSPECT = [
    (re.compile(r"\bctypes\b|\bcffi\b"), "calls into C (ctypes/cffi): memory and pages the readings cannot attribute"),
    (re.compile(r"\bmmap\b"), "memory maps (mmap): state kept in a file's pages"),
    (re.compile(r"\bmadvise\b"), "madvise: pages given back to the kernel"),
    (re.compile(r"\bshm_open\b|\bshared_memory\b|\bshmget\b|\bsysv_ipc\b|\bposix_ipc\b|/dev/shm"),
     "shared memory: state kept outside the rank"),
    (re.compile(r"\bgc\s*\.\s*freeze\b"), "gc.freeze: objects hidden from the collector"),
    (re.compile(r"\bsignal\s*\.\s*(signal|sigaction|setitimer|alarm|pthread_kill|pthread_sigmask)\b"),
     "signal handlers: a rank that acts on the grader's pauses"),
    (re.compile(r"(?<![.\w])(?<!def )(exec|eval|compile)\s*\("), "code run from strings (exec/eval/compile)"),
    (re.compile(r"(?<![.\w])__import__\s*\(|\bimport_module\s*\(\s*[^'\"\s)]"), "imports by computed name"),
]


def held(reason: str, *evidence: str) -> str:
    """A check's reason to hold its problem for review, with the evidence a TA reads."""
    return HELD + reason + "".join(f"; {e}" for e in evidence if e)


def is_held(reason: str) -> bool:
    return reason.startswith(HELD)


def scan(root: Path, read) -> list[str]:
    """``file:line: what`` for each line of the tree's Python files (``read``: files.read_regular,
    bounded, no link followed) that reaches for something in ``SUSPECT``, at most ``MAX_HITS``."""
    hits: list[str] = []
    files = sorted(p for p in root.rglob("*.py") if not p.is_symlink())
    if len(files) > MAX_FILES:
        return [f"{len(files)} Python files, more than the {MAX_FILES} the grader reads for this"]
    for path in files:
        try:
            text = read(path).decode(errors="replace")
        except OSError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern, what in SUSPECT:
                if pattern.search(code):
                    hits.append(f"{path.relative_to(root)}:{number}: {what}")
                    break
            if len(hits) >= MAX_HITS:
                return hits
    return hits


def reaches() -> list[str]:
    """The harness's scan of the submission being graded ([] when run by hand, on this checkout)."""
    try:
        found = json.loads(os.environ.get(SOURCES_ENV, "[]"))
    except ValueError:
        return ["the grader's scan of the source could not be read"]
    return [str(f) for f in found][:MAX_HITS] if isinstance(found, list) else []


def source_witness() -> str:
    """The source's witness as a hold's evidence, or "" when it reaches for nothing suspect."""
    found = reaches()
    return f"its source reaches for what can make an outside reading lie: {'; '.join(found)}" if found else ""
