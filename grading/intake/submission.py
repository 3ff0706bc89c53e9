"""A submission's tree: where its adapters are, which edition it answers, and loading them.

The harness reads the adapters file as text (``ast``), never importing it, to choose the edition;
only a rank imports it, through ``load_adapter``, which turns every way that can fail (no file, a
syntax error, an import error, the public stub's NotImplementedError) into a one-line reason.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import os
import sys
import types
import tomllib
from pathlib import Path

from grading.intake.files import SKIP_DIRS, read_regular
from grading.problems import EDITION_ADAPTERS

ADAPTER_FILES = ("tests/adapters.py", "adapters.py")  # the public layout first
MAX_VISITS = 5_000  # folders a workspace member's glob may visit, all members together


def syntax_error(path: Path, root: Path) -> str | None:
    try:
        ast.parse(read_regular(path), filename=str(path))
    except SyntaxError as e:
        return f"{path.relative_to(root)}:{e.lineno}: SyntaxError: {e.msg}"
    except (OSError, ValueError) as e:
        return f"{path.relative_to(root)}: cannot be read as Python source: {e}"
    return None


class AdapterMissing(Exception):
    """The submission does not provide an adapter; the message is the grade's one line."""


# What a rank's reason ends with when the adapters file could not be imported at all: the
# harness holds a submission whose every test ends so (harness.hold_if_nothing_imports).
AT_IMPORT = "while importing the submission's adapters"


def adapters_file(root: Path) -> Path | None:
    for name in ADAPTER_FILES:
        if (root / name).is_file():
            return root / name
    return None


def find_root(tree: Path) -> Path:
    """The folder holding the adapters: ``tree`` itself, or the one folder a zip wrapped it in."""
    if adapters_file(tree) or not tree.is_dir():
        return tree
    found = []
    for folder, dirs, files in os.walk(tree):  # a copy of at most MAX_FILES files
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and d != "site-packages"]
        if "adapters.py" in files:
            place = Path(folder)
            found.append(place.parent if place.name == "tests" else place)
    return min(found, key=lambda p: (len(p.parts), str(p))) if found else tree


def python_roots(root: Path, refused: list[str] | None = None) -> list[Path]:
    """Folders to import the submission's packages from, found as its own project finds them:
    the folders its pyproject.toml names (``[tool.uv.sources]`` path entries, e.g.
    ``cs336-basics = { path = "./cs336_basics_mine" }``, and ``[tool.uv.workspace]`` members), then
    its root, then ``cs336-basics/`` (the public layout); each as itself or its ``src/``. Only
    folders inside the submission count; ``refused`` gets a line for each path refused."""
    candidates = [*project_folders(root, refused), root, root / "cs336-basics"]
    found: list[Path] = []
    inside = root.resolve()
    for folder in candidates:
        for place in (folder / "src", folder):
            real = place.resolve()
            if place.is_dir() and (real == inside or inside in real.parents) and place not in found \
                    and (place == root or _has_packages(place)):
                found.append(place)
                if place != root / "src":  # the root itself always counts: its tests/adapters.py
                    break
    return found


def project_folders(root: Path, refused: list[str] | None = None) -> list[Path]:
    """The folders pyproject.toml names: path sources, then workspace members (globs expanded,
    visiting at most MAX_VISITS folders). A path that is absolute or leaves the submission is
    refused, with a line in ``refused``."""
    try:
        project = tomllib.loads(read_regular(root / "pyproject.toml").decode("utf-8", errors="replace"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return []
    uv = project.get("tool", {}).get("uv", {}) if isinstance(project.get("tool"), dict) else {}
    uv = uv if isinstance(uv, dict) else {}
    sources = uv.get("sources") if isinstance(uv.get("sources"), dict) else {}
    workspace = uv.get("workspace") if isinstance(uv.get("workspace"), dict) else {}
    members = workspace.get("members") if isinstance(workspace.get("members"), list) else []
    paths = [s["path"] for s in sources.values() if isinstance(s, dict) and isinstance(s.get("path"), str)]
    folders: list[Path] = []
    budget = [MAX_VISITS]
    for entry, glob in [*((p, False) for p in paths), *((m, True) for m in members if isinstance(m, str))]:
        if os.path.isabs(entry) or ".." in Path(entry).parts or "\0" in entry:
            if refused is not None:
                refused.append(f"pyproject.toml: {entry!r} is absolute or outside the submission: not used")
            continue
        folders += _expand(root, Path(entry).parts, budget) if glob else [root / entry]
    if budget[0] <= 0 and refused is not None:
        refused.append(f"pyproject.toml: workspace members visit more than {MAX_VISITS} folders: the rest not used")
    return folders


def _expand(folder: Path, parts: tuple[str, ...], budget: list[int]) -> list[Path]:
    """The folders under ``folder`` that the glob ``parts`` matches (``**``: any depth), in order,
    visiting at most ``budget[0]`` folders (spent from it); links are not followed."""
    if not parts:
        return [folder]
    budget[0] -= 1
    if budget[0] < 0 or folder.is_symlink() or not folder.is_dir():
        return []
    head, rest = parts[0], parts[1:]
    if head == "**":
        found = _expand(folder, rest, budget)
        for child in _children(folder):
            found += [f for f in _expand(child, parts, budget) if f not in found]
        return found
    if not any(c in head for c in "*?["):
        return _expand(folder / head, rest, budget)
    return [f for child in _children(folder) if fnmatch.fnmatchcase(child.name, head)
            for f in _expand(child, rest, budget)]


def _children(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def _has_packages(folder: Path) -> bool:
    return any((child / "__init__.py").is_file() for child in folder.iterdir() if child.is_dir())


def missing_packages(root: Path, adapters: Path | None, edition: str) -> list[str]:
    """One line for each of the course's packages (``cs336_*``) that the adapters import, or
    that the suite needs (cs336_basics, for 2026's FSDP), and that no folder of the submission
    holds: the places looked, as a TA would check them."""
    needed = {"cs336_basics"} if edition in ("2026", "both") else set()
    if adapters is not None:
        try:
            tree = ast.parse(read_regular(adapters))
        except (SyntaxError, OSError, ValueError):
            tree = ast.Module(body=[], type_ignores=[])
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            needed |= {n.split(".")[0] for n in names if n.startswith("cs336_")}
    roots = python_roots(root)
    places: dict[str, str] = {}
    for folder in [*project_folders(root), root / "cs336-basics", root]:
        label = "the root" if folder == root else f"{os.path.relpath(folder, root)}/"
        places.setdefault(label, label + ("" if folder.is_dir() else " (absent)"))
    lines = []
    for package in sorted(needed):
        if not any((r / package).is_dir() or (r / f"{package}.py").is_file() for r in roots):
            empty = [m for m in uninitialised_submodules(root) if package in m.replace("-", "_")]
            if empty:
                lines.append(f"git submodule not initialised: {', '.join(empty)} (upload with submodules). "
                             f"{package} is in it: git clone --recurse-submodules, or git submodule update --init "
                             "in a checkout, fetches it.")
                continue
            lines.append(f"Package {package} is not in the submission; looked in {', '.join(places.values())} "
                         "(pyproject.toml's [tool.uv.sources] paths and workspace members, cs336-basics/, the root).")
    return lines


def uninitialised_submodules(root: Path) -> list[str]:
    """The paths ``.gitmodules`` names whose folder is missing or empty in the submission: a
    checkout uploaded without ``--recurse-submodules`` (the public layout's ``cs336-basics``)."""
    try:
        text = read_regular(root / ".gitmodules").decode("utf-8", errors="replace")
    except OSError:
        return []
    paths = [line.split("=", 1)[1].strip() for line in text.splitlines()
             if line.strip().startswith("path") and "=" in line and line.split("=", 1)[0].strip() == "path"]
    empty = []
    for path in paths:
        folder = root / path
        if os.path.isabs(path) or ".." in Path(path).parts or "\0" in path:
            continue
        if folder.is_symlink() or not folder.is_dir() or not any(folder.iterdir()):
            empty.append(path)
    return empty


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
        tree = ast.parse(read_regular(path).decode("utf-8", errors="replace"), filename=str(path))
    except (SyntaxError, OSError, ValueError):
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

    ``tests/adapters.py`` is imported as ``tests.adapters`` from the submission's own ``tests``
    folder (by path: a ``tests`` package elsewhere on the path is not it), as its public tests
    import it. Raises AdapterMissing with a one-line reason; a stub's NotImplementedError is
    raised when the adapter is called, where the rank's reason names its file and line.
    """
    roots = [Path(r) for r in os.environ.get("GRADING_SUBMISSION_ROOTS", os.getcwd()).split(os.pathsep)]
    root = next((r for r in roots if adapters_file(r)), roots[0])
    path = adapters_file(root)
    if path is None:
        raise AdapterMissing(f"no adapters file ({' or '.join(ADAPTER_FILES)}) in the submission")
    module = sys.modules.get("grading_submission_adapters")
    if module is None:
        if path.parent.name == "tests":
            package = path.parent / "__init__.py"
            if package.is_file():
                spec = importlib.util.spec_from_file_location("tests", package,
                                                              submodule_search_locations=[str(path.parent)])
                tests = importlib.util.module_from_spec(spec)
                sys.modules["tests"] = tests
                spec.loader.exec_module(tests)
            else:  # no __init__.py: a namespace package, as Python would import that folder
                tests = types.ModuleType("tests")
                tests.__path__ = [str(path.parent)]
                sys.modules["tests"] = tests
            module_name = "tests.adapters"
        else:
            module_name = "adapters"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - any error at import: the one line says which, and where
            from grading.isolation.ranks import one_line  # rank side only: ranks.py imports this module

            del sys.modules[module_name]
            raise AdapterMissing(f"{one_line(e, [str(r) for r in roots])} ({AT_IMPORT}, "
                                 f"{path.relative_to(root)})") from e
        sys.modules["grading_submission_adapters"] = module
    fn = getattr(module, name, None)
    if fn is None:
        raise AdapterMissing(f"{path.relative_to(root)}: no adapter named {name}")
    return fn
