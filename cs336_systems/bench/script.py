"""What every benchmark script's ``main`` does: parse, run on the ranks, rank 0 writes and reports.

A script names its settings, its results kind, how to run and what to print; this module does
the rest in one way for all: flags from the settings (cs336_systems/cli), the results path
(``--out``, else ``--tag``'s folder), an interrupted run ending in one line and writing nothing,
only rank 0 writing under torchrun or SLURM, the environment recorded beside the records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from cs336_systems import cli
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


@dataclass(frozen=True)
class BenchmarkScript:
    """One benchmark's command line: its flags, its run, its console report."""

    settings: type  # a settings dataclass with CLI metadata, ``backend_name`` and ``device``
    kind: str  # the results kind it writes
    description: str  # the script's docstring
    run: Callable[[Any], BenchmarkRun]
    table: Callable[[list], str]  # the records as a console table
    # What to print once the results are written (default: the workload in one line, the table).
    report: Callable[[Any, BenchmarkRun], str] | None = None

    def build_parser(self) -> cli.Parser:
        """The flags, generated from the settings, plus --out and --tag."""
        return cli.Parser(self.settings, self.description, results_kind=self.kind)

    def main(self, argv: Sequence[str] | None = None) -> int:
        return cli.stops_cleanly(self._main)(argv)

    def _main(self, argv: Sequence[str] | None) -> int:
        setting, out = self.build_parser().parse_with_output(argv)
        run = self.run(setting)
        if run.rank != 0:
            return 0  # every rank holds the same figures; rank 0 writes them
        environment = collect_environment(setting.backend_name, run.world_size, setting.device, run.shared_gpu)
        save_results(out, self.kind, setting, run.records, environment, run.notes)
        if self.report is not None:
            print(self.report(setting, run))
        else:
            print(workload_line(setting, run.n_parameters, run.world_size))  # type: ignore[attr-defined]
            print(self.table(run.records))
        print(f"wrote {out}")
        return 0


def workload_line(setting: Any, n_parameters: int, world_size: int) -> str:
    """The setting of a run that trains the LM, in one console line."""
    return (f"{setting.model_size} ({n_parameters / 1e6:.1f}M parameters), {world_size} ranks, "
            f"{setting.backend_name}, global batch {setting.global_batch} x {setting.context_length} tokens")
