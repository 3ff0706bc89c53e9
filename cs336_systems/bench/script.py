"""What a benchmark script does once its run has returned: rank 0 writes it and reports.

A script is its flags (cs336_systems/cli, generated from the settings), a direct call of its
benchmark's run function, and its console report. Between the run and the report,
:func:`write_and_report` does the same for every benchmark: only rank 0 writes under torchrun
or SLURM (every rank holds the same figures), and the environment is recorded beside the
records. An interrupted run never gets here, so it writes nothing (``cli.stops_cleanly``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cs336_systems.bench.workload import WorkloadSetting
from cs336_systems.launch.setting import LaunchSetting
from cs336_systems.results.environment import collect_environment
from cs336_systems.results.files import save_results


@dataclass(frozen=True)
class BenchmarkRun:
    """What a benchmark returns on each process (each benchmark's run extends it)."""

    records: list  # the same on every rank
    world_size: int  # ranks of the job
    shared_gpu: bool  # ranks of a node took turns on one GPU
    rank: int  # this process's rank (0 when the ranks were spawned here): rank 0 writes

    @property
    def notes(self) -> dict[str, Any]:
        """Run-level figures for the results file (none unless a benchmark adds some)."""
        return {}


def write_and_report(out: Path, kind: str, setting: LaunchSetting, run: BenchmarkRun, report: str) -> int:
    """On rank 0: write ``run`` to ``out`` as a ``kind`` results file, then print ``report``; other
    ranks do neither (they hold the same figures). The script's exit status: 0."""
    if run.rank != 0:
        return 0
    environment = collect_environment(setting.backend_name, run.world_size, setting.device, run.shared_gpu)
    save_results(out, kind, setting, run.records, environment, run.notes)
    print(report)
    print(f"wrote {out}")
    return 0


def workload_line(setting: WorkloadSetting, n_parameters: int, world_size: int) -> str:
    """The setting of a run that trains the LM, in one console line."""
    return (f"{setting.model_size} ({n_parameters / 1e6:.1f}M parameters), {world_size} ranks, "
            f"{setting.backend_name}, global batch {setting.global_batch} x {setting.context_length} tokens")
