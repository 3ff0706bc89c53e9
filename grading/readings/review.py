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

import ast
import json
import os
import re
from pathlib import Path

HELD = "held for review: "
SOURCES_ENV = "GRADING_REACHES"  # the harness's scan of the submission (intake.py), as JSON
MAX_FILES = 2000  # .py files followed at most
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
    (re.compile(r"(?<![.\w])__import__\s*\(|\bimport_module\s*\(\s*[^'\"\s)]|\bspec_from_file_location\b|"
                r"\bSourceFileLoader\b|\bload_source\b|\brunpy\b|\bzipimport\b"), "imports by computed name or path"),
]


def held(reason: str, *evidence: str) -> str:
    """A check's reason to hold its problem for review, with the evidence a TA reads."""
    return HELD + reason + "".join(f"; {e}" for e in evidence if e)


def is_held(reason: str) -> bool:
    return reason.startswith(HELD)


def imported_files(start: list[Path], roots: list[Path], read) -> list[Path]:
    """The submission's Python files that ``start`` (its adapters, the course's model module)
    import, directly or through others, as far as the source says (``import``/``from ... import``
    anywhere in a file, relative ones included, and each package's ``__init__.py`` on the way):
    what a rank runs. A module loaded by a computed name is not followed; the pattern that loads
    it is itself a hit (``SUSPECT``)."""
    def module_files(name: str) -> list[Path]:
        parts, found = name.split("."), []
        for root in roots:
            for depth in range(1, len(parts) + 1):
                base = root.joinpath(*parts[:depth])
                found += [f for f in (base / "__init__.py", base.with_suffix(".py")) if f.is_file()]
        return found

    seen: list[Path] = []
    queue = [f for f in start if f.is_file()]
    while queue and len(seen) < MAX_FILES:
        path = queue.pop()
        if path in seen:
            continue
        seen.append(path)
        try:
            tree = ast.parse(read(path).decode(errors="replace"))
        except (OSError, SyntaxError, ValueError):
            continue
        root = next((r for r in roots if path.is_relative_to(r)), path.parent)
        package = list(path.relative_to(root).parent.parts) if path.is_relative_to(root) else []
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                here = package[:len(package) - node.level + 1] if node.level else []
                base = ".".join([*here, *(node.module.split(".") if node.module else [])])
                names = [base, *(f"{base}.{a.name}" if base else a.name for a in node.names)] if base or node.level \
                    else []
            for name in filter(None, names):
                queue += [f for f in module_files(name) if f not in seen]
    return seen


def scan(start: list[Path], roots: list[Path], read) -> list[str]:
    """``file:line: what`` for each line of the Python files a rank runs (``imported_files`` from
    ``start``; ``read``: files.read_regular, bounded, no link followed) that reaches for something
    in ``SUSPECT``, at most ``MAX_HITS``; paths relative to the first of ``roots``."""
    hits: list[str] = []
    files = imported_files(start, roots, read)
    for path in files:
        try:
            text = read(path).decode(errors="replace")
        except OSError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern, what in SUSPECT:
                if pattern.search(code):
                    where = path.relative_to(roots[0]) if path.is_relative_to(roots[0]) else path.name
                    hits.append(f"{where}:{number}: {what}")
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
