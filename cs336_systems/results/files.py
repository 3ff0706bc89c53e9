"""A results file: what was measured (records), with what (setting) and on what (environment).

On disk it is ``{"kind", "version", "environment", "setting", "notes", "records"}``, sorted and
indented so that reruns diff well. Files are written to a temporary file in the same folder and
renamed into place (:func:`write_atomic`), so a run killed while writing leaves the old file or
none, never half of one. :func:`read_results` checks the kind and version and rebuilds every
record as its dataclass; :class:`ResultsError` names the file and what is wrong with it.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Iterator, TypeVar

from cs336_systems.results.environment import Environment
from cs336_systems.results.paths import RESULTS_ROOT, SMOKE_PREFIX
from cs336_systems.results.schema import Record, SchemaError, from_json, to_json

R = TypeVar("R", bound=Record)


class ResultsError(ValueError):
    """A results file that cannot be read as what it claims to be."""


class LoadedMachine(ValueError):
    """A run taken while other jobs loaded the machine, refused a place among the results."""



def _among_results(path: Path) -> bool:
    """Whether ``path`` is a results file the writeup reads (under RESULTS_ROOT, not a smoke folder)."""
    try:
        relative = Path(path).resolve().relative_to(RESULTS_ROOT.resolve())
    except ValueError:
        return False
    return bool(relative.parts) and not relative.parts[0].startswith(SMOKE_PREFIX)


@dataclass
class ResultsFile(Generic[R]):
    """One run of one benchmark."""

    kind: str  # the records' KIND
    environment: Environment
    setting: dict[str, Any]  # the run's settings dataclass, as JSON
    records: list[R]
    notes: dict[str, Any] = field(default_factory=dict)  # run-level figures (parameter count, wall time)
    version: int = 1  # the records' VERSION when written
    path: Path | None = None  # where it was read from (not written)
    source: str = ""  # how readers are shown it, e.g. "<machine tag>/ddp_step.json" (not written)

    @property
    def name(self) -> str:
        """The file's stem, e.g. "ddp_step-ablation" (its kind when it was not read from a file)."""
        return self.path.stem if self.path else self.kind


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path``; renamed onto ``path`` if the block completes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    with atomic_path(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
    return Path(path)


def write_results(path: Path, results: ResultsFile) -> Path:
    """Write ``results`` to ``path`` atomically, as stable, diff-friendly JSON."""
    if not results.records:
        raise ValueError(f"refusing to write {path} with no records")
    kinds = {type(r).KIND for r in results.records}
    if kinds != {results.kind}:
        raise ValueError(f"records of kinds {sorted(kinds)} in a {results.kind!r} results file")
    document = {
        "kind": results.kind,
        "version": type(results.records[0]).VERSION,
        "environment": to_json(results.environment),
        "setting": results.setting,
        "notes": results.notes,
        "records": [to_json(r) for r in results.records],
    }
    return write_atomic(path, json.dumps(document, indent=2, sort_keys=True) + "\n")


def save_results(path: Path, kind: str, setting: Any, records: list, environment: Environment,
                 notes: dict[str, Any] | None = None) -> Path:
    """Write one run: its settings dataclass, records, environment and notes (see :func:`write_results`).

    LoadedMachine, and nothing written, for a run under ``writeup/results/`` (not a quick folder)
    whose recorded load exceeded what its own processes account for (environment.Load): its
    numbers would be the other jobs' as much as its own. Elsewhere (a test's folder) the run is
    written with its load, and the writeup never reads it."""
    load = environment.load
    if load is not None and load.exceeded and _among_results(path):
        raise LoadedMachine(f"not written to {path}: {load.describe()} ({load.why_busy()}), so its numbers are "
                            "not evidence; rerun on a quiet machine")
    return write_results(path, ResultsFile(kind, environment, to_json(setting), records, notes or {}))


def read_results(path: Path, record_types: dict[str, type[Record]], source: str | None = None) -> ResultsFile:
    """Read a results file whose kind is one of ``record_types`` (kind -> record class).

    ``source`` names the file in errors (default: its path).
    """
    source = source or str(path)
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultsError(f"cannot read results file {source}: {e}") from e
    if not isinstance(document, dict) or not isinstance(document.get("records"), list):
        raise ResultsError(f"{source} is not a results file: expected an object with a 'records' list")
    kind = document.get("kind")
    if kind not in record_types:
        raise ResultsError(f"{source}: unknown kind {kind!r}; known: {', '.join(sorted(record_types))}")
    cls = record_types[kind]
    if document.get("version") != cls.VERSION:
        raise ResultsError(
            f"{source}: {kind} results of schema version {document.get('version')!r}, this code reads "
            f"version {cls.VERSION}: rerun the benchmark that wrote it"
        )
    try:
        environment = from_json(Environment, document.get("environment"), f"{source}: environment")
        records = [from_json(cls, r, f"{source}: records[{i}]") for i, r in enumerate(document["records"])]
    except (SchemaError, TypeError) as e:
        raise ResultsError(str(e)) from e
    setting = document.get("setting") if isinstance(document.get("setting"), dict) else {}
    notes = document.get("notes") if isinstance(document.get("notes"), dict) else {}
    return ResultsFile(kind, environment, setting, records, notes, cls.VERSION, Path(path), source)
