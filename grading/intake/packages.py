"""Packages a submission declares that the grader's environment lacks: installed for it, or named.

A student's adapters may import a package its own project declares (``[project].dependencies``
of its ``pyproject.toml``, or of a project folder that file names, pinned by its ``uv.lock``) and
the course's environment does not have: beartype, say. Without it every test fails at import, a
zero a TA gives back at once. So the harness, before the suite runs:

* lists the declared distributions this Python cannot find (``missing``, in the intake
  subprocess, under the submission's limits);
* installs each, pinned as its lock pins it, without its dependencies and from wheels only
  (installing a wheel runs none of its code), into a folder of this submission's alone
  (``layer``), from a course wheelhouse (``GRADING_WHEELHOUSE``, a folder of wheels: no network
  needed) or else the package index; at most ``MAX_PACKAGES`` of them, ``MAX_LAYER_BYTES`` in
  all, within ``INSTALL_TIMEOUT_S``. The ranks put that folder on their path after the
  submission's own folders (ranks._use_submission): it shadows nothing, and it is read-only to
  them, as the submission's copy is;
* names what it installed, and what it could not, in grade.md's first lines; a test that fails
  because a package it could not install is missing is held for review with the package named
  (``hold_unavailable``), never a silent zero.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from grading.intake.files import read_regular
from grading.isolation import preload
from grading.readings.review import HELD, held

MAX_PACKAGES = 10
MAX_LAYER_BYTES = 256 << 20
INSTALL_TIMEOUT_S = 180.0
WHEELHOUSE_ENV = "GRADING_WHEELHOUSE"
LAYER_ENV = "GRADING_SUBMISSION_PACKAGES"  # the layer, as the ranks find it
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _toml(path: Path) -> dict:
    try:
        return tomllib.loads(read_regular(path).decode("utf-8", errors="replace"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}


def declared(root: Path, projects: list[Path]) -> dict[str, str]:
    """Each distribution the submission's projects declare (``root`` and the folders its
    pyproject.toml names), by normalized name, with the version its ``uv.lock`` pins ("" if none);
    not those with a source of their own (``[tool.uv.sources]``) nor the course's (``cs336-*``)."""
    names: dict[str, str] = {}
    local: set[str] = set()
    for folder in [root, *projects]:
        uv = (_toml(folder / "pyproject.toml").get("tool") or {}).get("uv") or {}
        local |= {normalized(str(k)) for k in (uv.get("sources") or {} if isinstance(uv, dict) else {})}
    for folder in [root, *projects]:
        project = _toml(folder / "pyproject.toml").get("project")
        requirements = project.get("dependencies") if isinstance(project, dict) else None
        for requirement in requirements if isinstance(requirements, list) else []:
            if isinstance(requirement, str) and (match := _NAME.match(requirement)) and ";" not in requirement:
                names.setdefault(normalized(match.group(1)), "")
    for package in _toml(root / "uv.lock").get("package") or []:
        if isinstance(package, dict) and normalized(str(package.get("name", ""))) in names:
            names[normalized(str(package["name"]))] = str(package.get("version", ""))
    # a source of its own (a path, a git repository, a workspace member: the course's cs336-basics)
    # is the submission's, never a name to look up in an index, where anyone may have taken it
    return {n: v for n, v in names.items() if n not in local and not n.startswith("cs336")}


def missing(root: Path, projects: list[Path]) -> list[str]:
    """The declared distributions this Python cannot find, as ``name==version`` (or ``name``);
    the submission's own projects (installed in editable mode, or found as folders) excluded."""
    own = {normalized(str((_toml(f / "pyproject.toml").get("project") or {}).get("name", "")))
           for f in [root, *projects]}
    found = []
    for name, version in sorted(declared(root, projects).items()):
        if name in own:
            continue
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name}=={version}" if version else name)
    return found


# A distribution's name as PEP 508 writes it, and at most this long: the .dist-info folder's name.
_DIST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,98}[A-Za-z0-9])?$")
UNVERSIONED = "0"  # a project whose version is dynamic (its build backend computes it): not run here


def own_projects(root: Path, projects: list[Path]) -> list[tuple[str, str]]:
    """The submission's own projects (its root and the folders its pyproject.toml names: path
    sources, workspace members), as ``uv sync`` installs them: (name, version) from each
    ``[project]`` table, a name that is no distribution name skipped, a version PEP 440 does not
    read (or a dynamic one) written as ``UNVERSIONED``. Read as text: no build backend runs."""
    from packaging.version import InvalidVersion, Version

    found: dict[str, tuple[str, str]] = {}
    for folder in [root, *projects]:
        project = _toml(folder / "pyproject.toml").get("project")
        name = project.get("name") if isinstance(project, dict) else None
        if not isinstance(name, str) or not _DIST_NAME.match(name):
            continue
        try:
            version = str(Version(str(project.get("version"))))
        except InvalidVersion:
            version = UNVERSIONED
        found.setdefault(normalized(name), (name, version))
    return list(found.values())


def write_metadata(projects: list[tuple[str, str]], layer: Path) -> list[str]:
    """A ``.dist-info`` of METADATA alone in ``layer`` for each of the submission's own projects
    (``own_projects``) that neither the layer nor this environment has, as ``uv sync`` leaves
    one: ``importlib.metadata.version("cs336_basics")`` at import then answers as in the course's
    environment (a public student's assignment-1 package does it; every test failed at import
    without). Static text from its pyproject.toml, written by the harness: its build backend,
    the submission's own code, never runs, here or anywhere. What was written, as name==version."""
    written = []
    for name, version in projects:
        wheel_name = re.sub(r"[-_.]+", "_", name).lower()  # the wheel spec's escaping of a .dist-info name
        try:
            importlib.metadata.distribution(name)
            continue  # this environment has it already: the course's
        except importlib.metadata.PackageNotFoundError:
            pass
        if layer.is_dir() and any(normalized(p.name.split("-")[0]) == normalized(name) for p in layer.glob("*.dist-info")):
            continue
        info = layer / f"{wheel_name}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("grading\n")
        written.append(f"{name}=={version}")
    return written


def absent_imports(unresolved: list[str], layer: Path) -> list[str]:
    """The top-level names the submission's files import that neither it, this environment nor
    what was installed for it provides; the course's packages (``cs336_*``) are named apart
    (submission.missing_packages)."""
    tops = dict.fromkeys(n.split(".")[0] for n in unresolved if not n.startswith("cs336"))
    return [n for n in tops if not provided([n], layer)]


def absent_remark(names: list[str]) -> str:
    return (f"Imports {', '.join(names)}, which neither the submission, nor the course's environment, nor a package "
            "its pyproject.toml declares provides: a test that fails on one of them says so.")


MAX_PRELOAD = 40  # libraries the fork server imports for a submission at most
PRELOAD_ENV = preload.PRELOAD_ENV  # what the harness tells the fork server to import (defined once, there)
COMPILE = "torch.compile"  # in that list: a file decorates with torch.compile, whose first call imports ~600 modules


def libraries(roots: list[Path], max_files: int = 2000) -> tuple[list[str], list[str]]:
    """The libraries of this Python's environment that the submission's files import (top-level
    names, neither the standard library's nor the submission's own packages), and ``COMPILE``
    where a file calls ``torch.compile``: the fork server imports them once per grading, so a
    rank, forked from it, does not import them again (each rank did: a ``torch.compile``'d
    function cost 2.5 s per rank). Only modules installed outside the submission are named; the
    fork server imports them from this environment, never from the submission's folders. Beside
    them, the names found nowhere here (a declared package installed later, ``install``, may
    provide them)."""
    import ast
    import importlib.util

    own = {p.name.removesuffix(".py") for r in roots if r.is_dir() for p in r.iterdir()}
    names: set[str] = set()
    compiled = False
    files = [f for r in roots for f in _python_files(r, max_files)][:max_files]
    own |= {f.stem for f in files} | {f.parent.name for f in files}  # a script's sibling module is its own
    for path in files:
        try:
            tree = ast.parse(read_regular(path))
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):  # whole dotted names: matplotlib.pyplot is the costly part
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
            elif isinstance(node, ast.Attribute) and node.attr == "compile" and \
                    isinstance(node.value, ast.Name) and node.value.id == "torch":
                compiled = True
    found, unresolved = [], []
    tops = {n.split(".")[0] for n in names} - own - set(sys.stdlib_module_names) - {"torch", "grading"}
    for name in sorted(n for n in names if n.split(".")[0] in tops):
        try:
            spec = importlib.util.find_spec(name.split(".")[0])
        except (ImportError, ValueError):
            continue
        if spec is None:
            unresolved.append(name)
            continue
        origin = spec.origin or (list(spec.submodule_search_locations or [""])[0])
        if origin and "site-packages" in origin:
            found.append(name)
    return found[:MAX_PRELOAD] + ([COMPILE] if compiled else []), unresolved[:MAX_PRELOAD]


def provided(names: list[str], layer: Path) -> list[str]:
    """Those of ``names`` that the packages installed for the submission (``layer``) provide."""
    return [n for n in names if (layer / n.split(".")[0] / "__init__.py").is_file()
            or (layer / f"{n.split('.')[0]}.py").is_file()]


def _python_files(root: Path, budget: int) -> list[Path]:
    """``root``'s .py files, breadth first, no link followed, at most ``budget``."""
    from grading.intake.files import SKIP_DIRS

    found, queue = [], [root]
    while queue and len(found) < budget:
        folder = queue.pop(0)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False) and entry.name not in SKIP_DIRS and not entry.name.startswith("."):
                queue.append(Path(entry.path))
            elif entry.is_file(follow_symlinks=False) and entry.name.endswith(".py"):
                found.append(Path(entry.path))
    return found


def _installer() -> list[str] | None:
    """The command that installs into a folder: this Python's pip, else uv's (a uv environment
    has no pip)."""
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0:
        return [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    uv = shutil.which("uv")
    command = [uv] if uv else [sys._base_executable, "-m", "uv"] if hasattr(sys, "_base_executable") else None
    if command and subprocess.run([*command, "--version"], capture_output=True).returncode == 0:
        return [*command, "pip", "install", "--python", sys.executable]
    return None


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())


def install(specs: list[str], layer: Path) -> tuple[list[str], dict[str, str]]:
    """Install ``specs`` into ``layer`` (see the module); what was installed, and why each of
    the others was not."""
    installer, wheels = _installer(), os.environ.get(WHEELHOUSE_ENV)
    if installer is None:
        return [], dict.fromkeys(specs, "no installer (pip or uv) here")
    source = ["--no-index", "--find-links", wheels] if wheels else []
    done, failed = [], {}
    for spec in specs[:MAX_PACKAGES]:
        try:
            run = subprocess.run([*installer, "--no-deps", "--only-binary", ":all:", "--target", str(layer), *source,
                                  spec], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            failed[spec] = f"no answer within {INSTALL_TIMEOUT_S:.0f} s"
            continue
        if run.returncode != 0:
            failed[spec] = ((run.stderr or run.stdout).strip().splitlines() or ["failed"])[-1][:200]
        elif layer.exists() and _size(layer) > MAX_LAYER_BYTES:
            failed[spec] = f"over the {MAX_LAYER_BYTES >> 20} MiB a submission's packages may take"
            shutil.rmtree(layer, ignore_errors=True)
            return [], {**failed, **dict.fromkeys([s for s in specs if s not in failed], "layer removed")}
        else:
            done.append(spec)
    failed.update(dict.fromkeys(specs[MAX_PACKAGES:], f"more than {MAX_PACKAGES} packages to install"))
    return done, failed


def remarks(done: list[str], failed: dict[str, str]) -> list[str]:
    """grade.md's first lines about the declared packages."""
    lines = []
    if done:
        lines.append(f"Installed for this submission (declared in its pyproject.toml, not in the grader's "
                     f"environment): {', '.join(done)}.")
    for spec, why in failed.items():
        lines.append(f"Needs package {spec.split('==')[0]}, declared in pyproject.toml, which this grader could not "
                     f"install ({why}): tests that fail on its import are held for review.")
    return lines


def python_needed(root: Path) -> str | None:
    """The Python the submission's ``requires-python`` asks for, where it excludes this one
    (2026 submissions declare ``>=3.12``: ``typing.override`` does not exist in 3.11)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    wanted = (_toml(root / "pyproject.toml").get("project") or {}).get("requires-python")
    try:
        ok = isinstance(wanted, str) and platform_version() not in SpecifierSet(wanted)
    except InvalidSpecifier:
        return None
    return wanted if ok else None


def platform_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


# A rank's failure that says it needs a GPU (a CUDA or Triton self-test run at import): this
# grader has none, as the course's own tests run on CPU, and a TA decides.
GPU_NEEDED = re.compile(r"active drivers|NVIDIA driver|CUDA driver|no CUDA GPUs|not compiled with CUDA|"
                        r"Torch not compiled with CUDA|cuda runtime error|CUDA error", re.I)


def hold_unrunnable(reason: str, python: str | None) -> str:
    """A failure held for review when it comes from what this grader lacks, not from the code:
    a GPU, or the Python the submission declares (an import or syntax error there)."""
    if reason.startswith(HELD):
        return reason
    if GPU_NEEDED.search(reason):
        return held("it needs a GPU, which this grader has none of (its tests run on CPU, as the course's do)", reason)
    if python and re.search(r"ImportError|SyntaxError|AttributeError: module '", reason):
        return held(f"it declares Python {python} (requires-python) and this grader runs {platform_version()}", reason)
    newer = re.search(r"cannot import name '\w+' from '([\w.]+)'", reason)
    if newer and newer.group(1).split(".")[0] in sys.stdlib_module_names:
        return held(f"it imports from the standard library's {newer.group(1)} a name this grader's Python "
                    f"{platform_version()} lacks (a newer Python has it)", reason)
    return reason


def hold_unavailable(reason: str, failed: list[str]) -> str:
    """A test's failure, held for review when it is a missing module that a declared package the
    grader could not install provides (by name: ``beartype`` for ``beartype``, ``foo_bar`` for
    ``foo-bar``)."""
    match = re.search(r"No module named '([\w.]+)'", reason)
    if not match:
        return reason
    module = normalized(match.group(1).split(".")[0])
    for spec in failed:
        if normalized(spec.split("==")[0]) == module:
            return held(f"needs package {spec.split('==')[0]}, declared in pyproject.toml, which this grader could "
                        "not install", reason)
    return reason
