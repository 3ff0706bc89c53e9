"""Every kind of results file and the record class it holds, so that any reader can read any file.

The classes are named by module path and imported when a file of their kind is read, so that
reading all-reduce results does not import (or depend on) the step benchmark's code.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from cs336_systems.results.files import ResultsError, ResultsFile, read_results
from cs336_systems.results.schema import Record

# kind -> "module:Class"; the kind is also the results file's name (see paths.py).
KINDS = {
    "allreduce": "cs336_systems.bench.allreduce.record:AllReduceRecord",
    "naive_ddp": "cs336_systems.bench.equivalence:EquivalenceRecord",
    "ddp_step": "cs336_systems.bench.step.record:StepRecord",
    "profile": "cs336_systems.bench.profile.record:ProfileRecord",
    "sharded_optimizer": "cs336_systems.bench.accounting.record:AccountingRecord",
    "fsdp_step": "cs336_systems.bench.fsdp.record:FsdpStepRecord",
    "answers_step": "cs336_systems.bench.answers.record:AnswersStepRecord",
    "fsdp_options": "cs336_systems.bench.fsdp.options_run:FsdpOptionRecord",
    "fsdp_modules": "cs336_systems.bench.fsdp.modules_run:FsdpModuleRecord",
    "doctor": "cs336_systems.doctor.report:DoctorReport",
    "grades": "cs336_systems.problems:GradeRecord",
    "bucket_family": "cs336_systems.bench.family.record:FamilyRecord",
    "ffn_bytes": "cs336_systems.capacity.ffn_bytes:FfnBytesRecord",
    "lightning_claims": "cs336_systems.bench.claims.record:ClaimsRecord",
    "fsdp_memory": "cs336_systems.bench.fsdp.memory:FsdpMemoryRecord",
}


def record_type(kind: str) -> type[Record]:
    """The record class of ``kind``; ValueError for a kind not listed in :data:`KINDS`."""
    if kind not in KINDS:
        raise ValueError(f"unknown results kind {kind!r}; known: {', '.join(sorted(KINDS))}")
    module, _, name = KINDS[kind].partition(":")
    return getattr(importlib.import_module(module), name)


class _Lazy(dict):
    """kind -> record class, importing each class the first time it is looked up."""

    def __contains__(self, kind: object) -> bool:
        return kind in KINDS

    def __getitem__(self, kind: str) -> type[Record]:
        return record_type(kind)

    def __iter__(self):
        return iter(KINDS)


def read_any(path: Path, source: str | None = None) -> ResultsFile:
    """Read a results file of any known kind; ResultsError names what is wrong with it."""
    try:
        return read_results(path, _Lazy(), source)
    except (ImportError, AttributeError) as e:
        raise ResultsError(f"{source or path}: cannot load the record class of its kind: {e}") from e
