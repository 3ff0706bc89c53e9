"""Finding and reading the results the writeup is built from.

Layout (see :mod:`cs336_systems.results.paths`)::

    <results root>/<machine tag>/<kind>[-<run>].json     typed results files (results.files)
    <results root>/<machine tag>/profile/profile.json    the profiler's timelines, as intervals
    <results root>/<machine tag>/profile/trace_*.json*   the profiler's raw Chrome traces

Each file is read as a :class:`~cs336_systems.results.files.ResultsFile` whose ``source`` is
"<machine tag>/<file name>", the path shown to readers, and its records' floats settled to
``INPUT_DIGITS`` significant digits (:func:`settle`). A kind may have several files, e.g. ``ddp_step.json`` and ``ddp_step-ablation.json``; they are
its runs, in sorted order. Folders whose name starts with ``quick`` hold smoke runs and are
skipped unless asked for by name. A file that cannot be read (truncated, another schema
version, not a results file) is set aside and named in the writeup, which goes on with the
rest. Everything is read in sorted order, so the same files always give the same writeup.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from cs336_systems.results.files import ResultsError, ResultsFile
from cs336_systems.results.kinds import read_any
from cs336_systems.results.paths import PROFILE_DIR, SMOKE_PREFIX


DIGITS = 4  # fitted numbers: more than the pages show (3), far fewer than float noise between CPUs (~15)
INPUT_DIGITS = 9  # measured values: microseconds of a second-long step, not the last bits of a float


def settled(value: float, digits: int = DIGITS) -> float:
    """``value`` to ``digits`` significant digits: what is shown or drawn never carries float noise."""
    return float(f"{value:.{digits}g}")


def settle(obj: Any, digits: int = INPUT_DIGITS) -> Any:
    """A record (dataclass, list, dict) with every float settled: the same pages from noisy copies of it."""
    if isinstance(obj, float):
        return settled(obj, digits)
    if isinstance(obj, (list, tuple)):
        return type(obj)(settle(x, digits) for x in obj)
    if isinstance(obj, dict):
        return {k: settle(x, digits) for k, x in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: settle(getattr(obj, f.name), digits)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


WORKLOAD = ("model_size", "context_length", "global_batch")  # what runs compared across files share

@dataclass
class MachineResults:
    """Everything measured on one machine (one results folder)."""

    tag: str
    folder: Path
    files: dict[str, ResultsFile] = field(default_factory=dict)  # by stem, sorted
    unreadable: dict[str, str] = field(default_factory=dict)  # file name -> why it was set aside

    def runs(self, kind: str, like: ResultsFile | None = None) -> list[ResultsFile]:
        """Files of one kind, in name order; with ``like``, only those of its workload (model, context, batch)."""
        return [f for f in self.files.values() if f.kind == kind and (like is None or all(
            f.setting.get(k) == like.setting.get(k) for k in WORKLOAD))]

    def get(self, name: str) -> ResultsFile | None:
        return self.files.get(name)


@dataclass
class WriteupInputs:
    """All machines' results, in sorted tag order."""

    results_root: Path
    machines: list[MachineResults]

    def runs(self, kind: str) -> list[tuple[MachineResults, ResultsFile]]:
        """Every (machine, file) pair of one kind, machines in tag order."""
        return [(m, f) for m in self.machines for f in m.runs(kind)]


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


def load_machine(folder: Path) -> MachineResults:
    """Read every results file of one machine folder (and its profile/ subfolder)."""
    tag = folder.name
    machine = MachineResults(tag, folder)
    paths = sorted(folder.glob("*.json")) + sorted((folder / PROFILE_DIR).glob("profile*.json"))
    for path in paths:
        name = path.relative_to(folder).as_posix()
        source = f"{tag}/{name}"
        try:
            results = read_any(path, source)
            machine.files[name.removesuffix(".json")] = dataclasses.replace(results, records=settle(results.records))
        except ResultsError as e:
            machine.unreadable[name] = str(e)
    return machine


def load_results(results_root: Path, include_tags: Iterable[str] = ()) -> WriteupInputs:
    """Every machine folder under ``results_root`` (see :func:`machine_tags`), loaded."""
    results_root = Path(results_root)
    tags = machine_tags(results_root, include_tags)
    return WriteupInputs(results_root, [load_machine(results_root / tag) for tag in tags])
