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
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, Iterator, TypeVar

from cs336_systems.results import environment as environment_module
from cs336_systems.results.environment import OTHERS_LIMIT, OTHERS_LIMIT_BY_KIND, Environment
from cs336_systems.results.paths import NOT_QUIET_DIR, RESULTS_ROOT, SMOKE_PREFIX
from cs336_systems.results.schema import Record, SchemaError, from_json, to_json

R = TypeVar("R", bound=Record)
FILE_MODE = 0o644  # every file written here: rw-r--r--, the mode git records for them


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
    """A temporary path beside ``path`` (mode :data:`FILE_MODE`); renamed onto ``path`` if the block completes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, FILE_MODE)  # mkstemp makes it 0600; results and pages are read by everyone, as git has them
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
    """Write one run: its settings dataclass, records, environment and notes (see :func:`write_results`);
    the path written.

    The environment gets what the host did over the run (results.host, where the script watched
    it) and its verdict: quiet, or not and why. Under ``writeup/results/`` (not a quick folder):

    * LoadedMachine, and nothing written, for a run whose recorded load exceeded what its own
      processes account for (environment.Load, held to its kind's limit): its numbers would be
      the other jobs' as much as its own;
    * a run that is not quiet never replaces a quieter run of the same benchmark: it is filed in
      the machine folder's ``not-quiet/`` subfolder (which the writeup does not read) instead, and
      the path says so. Where the file in place is no quieter, the new run replaces it, marked."""
    environment = _with_host(environment, kind, records)
    load = environment.load
    if load is not None and load.exceeded and _among_results(path):
        raise LoadedMachine(f"not written to {path}: {load.describe()} ({load.why_busy()}), so its numbers are "
                            "not evidence; rerun on a quiet machine")
    results = ResultsFile(kind, environment, to_json(setting), records, notes or {})
    if _among_results(path) and environment.host is not None and not environment.host.quiet \
            and not _replaces(Path(path), environment):
        path = Path(path).parent / NOT_QUIET_DIR / Path(path).name
        print(f"not quiet ({'; '.join(environment.host.reasons)}): filed as {path}, beside the quieter run in "
              "place", file=sys.stderr)
    return write_results(path, results)


def _with_host(environment: Environment, kind: str, records: list) -> Environment:
    """``environment`` with its kind's load limit, and the host's record and verdict where watched."""
    load = environment.load
    if load is not None:
        load = replace(load, others_limit=OTHERS_LIMIT_BY_KIND.get(kind, OTHERS_LIMIT))
    watch = environment_module.HOST_WATCH
    host = environment.host if watch is None else watch.record(records)
    if host is not None:
        host = host.verdict(load.why_busy() if load is not None and load.exceeded else None)
    return replace(environment, load=load, host=host)


def _replaces(path: Path, new: Environment) -> bool:
    """Whether a run that is not quiet (``new``) may replace the file at ``path``: none is there, it
    cannot be read, or it is no quieter (not quiet itself, with a spread no narrower where both
    have one). A file without a host record says nothing of its quiet: the new run, which does, replaces it."""
    from cs336_systems.results.kinds import read_any

    try:
        old = read_any(path).environment.host
    except (OSError, ResultsError):
        return True
    if old is None or old.quiet is None:
        return True
    if old.quiet:
        return False
    if old.compute_only_iqr is not None and new.host.compute_only_iqr is not None:
        return new.host.compute_only_iqr <= old.compute_only_iqr
    return True


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
