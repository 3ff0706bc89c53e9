"""A submission's tree: where its adapters are, which edition it answers, and loading them.

The harness reads the adapters file as text (``ast``), never importing it, to choose the edition;
only a rank imports it, through ``load_adapter``, which turns every way that can fail (no file, a
syntax error, an import error, the public stub's NotImplementedError) into a one-line reason.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from grading.problems import EDITION_ADAPTERS

ADAPTER_FILES = ("tests/adapters.py", "adapters.py")  # the public layout first


class AdapterMissing(Exception):
    """The submission does not provide an adapter; the message is the grade's one line."""


def adapters_file(root: Path) -> Path | None:
    for name in ADAPTER_FILES:
        if (root / name).is_file():
            return root / name
    return None


def find_root(tree: Path) -> Path:
    """The folder holding the adapters: ``tree`` itself, or the one folder a zip wrapped it in."""
    if adapters_file(tree) or not tree.is_dir():
        return tree
    found = sorted({p.parent.parent if p.parent.name == "tests" else p.parent
                    for p in tree.rglob("adapters.py") if ".venv" not in p.parts and "site-packages" not in p.parts},
                   key=lambda p: len(p.parts))
    return found[0] if found else tree


def python_roots(root: Path) -> list[Path]:
    """Folders to import the submission's packages from: its root (``cs336_systems``, and
    ``cs336_basics`` if it sits there), and ``cs336-basics/``, where the public layout keeps it."""
    return [root, root / "cs336-basics"] if (root / "cs336-basics" / "cs336_basics").is_dir() else [root]


def _is_stub(fn: ast.FunctionDef) -> bool:
    """A body of only a docstring, ``pass``, ``...`` or ``raise NotImplementedError``."""
    for stmt in fn.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue
        if isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, ast.Raise) and stmt.exc is not None:
            exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
            if isinstance(exc, ast.Name) and exc.id == "NotImplementedError":
                continue
        return False
    return True


def implemented_adapters(path: Path) -> tuple[set[str], set[str]]:
    """(names the file provides, names it implements): defined with a real body, or imported."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"), filename=str(path))
    except SyntaxError:
        return set(), set()
    named, implemented = set(), set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            named.add(node.name)
            if not _is_stub(node):
                implemented.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                named.add(alias.asname or alias.name)
                implemented.add(alias.asname or alias.name)
    return named, implemented


def detect_edition(root: Path) -> str:
    """"2025" or "2026": the edition whose adapters the file implements (more of them wins; a
    tie or the bare stub goes by which edition's names the file has; 2026 if it has both)."""
    path = adapters_file(root)
    if path is None:
        return "2026"
    named, implemented = implemented_adapters(path)
    score = {e: (len(implemented & set(names)), len(named & set(names))) for e, names in EDITION_ADAPTERS.items()}
    return max(sorted(score, reverse=True), key=lambda e: score[e])


def load_adapter(name: str):
    """The submission's adapter ``name``, imported in this (rank) process.

    Raises AdapterMissing with a one-line reason; a stub's NotImplementedError is raised when the
    adapter is called, where the rank's reason names its file and line.
    """
    roots = [Path(r) for r in os.environ.get("GRADING_SUBMISSION_ROOTS", os.getcwd()).split(os.pathsep)]
    path = adapters_file(roots[0])
    if path is None:
        raise AdapterMissing(f"no adapters file ({' or '.join(ADAPTER_FILES)}) in the submission")
    if path.parent.name == "tests" and (path.parent / "__init__.py").is_file():
        module = importlib.import_module("tests.adapters")  # as the public tests import it
    else:
        spec = importlib.util.spec_from_file_location("adapters", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["adapters"] = module
        spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if fn is None:
        raise AdapterMissing(f"{path.relative_to(roots[0])}: no adapter named {name}")
    return fn
