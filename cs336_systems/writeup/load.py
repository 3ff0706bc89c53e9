"""Finding and reading the results the writeup is built from.

Layout (written by the benchmark scripts through ``cs336_systems.run_metadata``)::

    <results root>/<machine tag>/<benchmark>.json          {"meta": {...}, "records": [...]}
    <results root>/<machine tag>/profile/profile.json      the profiler's findings
    <results root>/<machine tag>/profile/timeline_*.png    the profiler's timelines

A benchmark may have several files, e.g. ``ddp_step.json`` and ``ddp_step-xl.json``; they are
its runs, in sorted order. Folders whose name starts with ``quick`` hold smoke runs and are
skipped unless asked for by name; a JSON file that is not a results file is set aside and
named in the writeup rather than failing it. Everything is read in sorted order, so the same files always
give the same writeup.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

SMOKE_PREFIX = "quick"  # results folders named quick* hold smoke runs, not results
PROFILE_DIR = "profile"


@dataclass(frozen=True)
class ResultsFile:
    """One results file: its name, where it is, and its content."""

    name: str  # file stem, e.g. "ddp_step"
    path: Path
    source: str  # the path shown to readers: "<machine tag>/<file name>"
    meta: dict[str, Any]
    records: list[dict[str, Any]]


@dataclass
class MachineResults:
    """Everything measured on one machine (one results folder)."""

    tag: str
    folder: Path
    files: dict[str, ResultsFile] = field(default_factory=dict)  # by stem, sorted
    profile: ResultsFile | None = None  # profile/profile.json
    profile_images: dict[str, Path] = field(default_factory=dict)  # stem -> PNG, sorted
    unreadable: dict[str, str] = field(default_factory=dict)  # file name -> why it was set aside

    def runs(self, benchmark: str) -> list[ResultsFile]:
        """Files of one benchmark: ``<benchmark>.json`` and ``<benchmark>[-_]<anything>.json``."""
        prefixes = (benchmark + "-", benchmark + "_")
        return [f for name, f in self.files.items() if name == benchmark or name.startswith(prefixes)]

    def get(self, name: str) -> ResultsFile | None:
        return self.files.get(name)


@dataclass
class WriteupInputs:
    """All machines' results, in sorted tag order."""

    results_root: Path
    machines: list[MachineResults]

    def runs(self, benchmark: str) -> list[tuple[MachineResults, ResultsFile]]:
        """Every (machine, file) pair of one benchmark, machines in tag order."""
        return [(m, f) for m in self.machines for f in m.runs(benchmark)]


def machine_tags(results_root: Path, include_tags: Iterable[str] = ()) -> list[str]:
    """Result folders to render, sorted; ``quick*`` folders only when named in ``include_tags``."""
    include = set(include_tags)
    if not results_root.is_dir():
        return []
    return sorted(
        p.name
        for p in results_root.iterdir()
        if p.is_dir() and (not p.name.startswith(SMOKE_PREFIX) or p.name in include)
    )


def read_results_file(path: Path, source: str) -> ResultsFile:
    """Parse one ``{"meta", "records"}`` file; errors name it by ``source`` (no machine-specific path)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read results file {source}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError(f"{source} is not a results file: expected an object with a 'records' list")
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    return ResultsFile(path.stem, path, source, meta, data["records"])


def load_machine(folder: Path) -> MachineResults:
    """Read every results file of one machine folder (and its profile/ subfolder)."""
    tag = folder.name
    machine = MachineResults(tag, folder)
    for path in sorted(folder.glob("*.json")):
        try:
            machine.files[path.stem] = read_results_file(path, f"{tag}/{path.name}")
        except ValueError as e:
            machine.unreadable[path.name] = str(e)
    profile_dir = folder / PROFILE_DIR
    profile_json = profile_dir / "profile.json"
    if profile_json.is_file():
        name = f"{PROFILE_DIR}/profile.json"
        try:
            machine.profile = read_results_file(profile_json, f"{tag}/{name}")
        except ValueError as e:
            machine.unreadable[name] = str(e)
    for png in sorted(profile_dir.glob("*.png")):
        machine.profile_images[png.stem] = png
    return machine


def load_results(results_root: Path, include_tags: Iterable[str] = ()) -> WriteupInputs:
    """Every machine folder under ``results_root`` (see :func:`machine_tags`), loaded."""
    results_root = Path(results_root)
    tags = machine_tags(results_root, include_tags)
    return WriteupInputs(results_root, [load_machine(results_root / tag) for tag in tags])
