"""bucket_size_mb="auto" against the 25 MB default on a family of model shapes (beyond the handout).

For each model of cs336_systems.bench.family.FAMILY (many small parameters, a few huge ones,
stock torch.nn encoder layers, our LM at cpu-small), times compute-only, bucketed-auto (warmed
up through its tuning steps), bucketed-25MB and torch's DDP interleaved round by round in one
process group, and writes one record per model (the variants' step records, what auto chose,
and auto − 25 MB paired round by round with its 95% interval) to
writeup/results/<tag>/bucket_family.json.

Three ways to run it:

    # plain command: spawns the ranks on this machine (gloo on CPU; about 2-3 minutes on 2 cores)
    python scripts/bench_bucket_family.py --world-size 2 --rounds 16

    # under torchrun: one process per rank, rendezvous from the environment
    torchrun --nproc-per-node 2 scripts/bench_bucket_family.py --device cuda

    # on a SLURM cluster through submitit (nodes x GPUs per node ranks)
    python scripts/submit_slurm.py --nodes 1 --gpus-per-node 2 -- scripts/bench_bucket_family.py --device cuda
"""

from __future__ import annotations

import sys

from cs336_systems import cli
from cs336_systems.bench.family import FamilyRecord, FamilyRun, FamilySetting, run_family_benchmark
from cs336_systems.launch import Interrupted
from cs336_systems.results.environment import collect_environment
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.schema import to_json


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def format_records(records: list[FamilyRecord]) -> str:
    """The console table: one row per model."""
    rows = []
    for r in records:
        by = {s.variant: s for s in r.steps}
        interval = r.auto_minus_default_ci95_s
        rows.append([r.model, f"{r.gradient_bytes / 2**20:.1f}", f"{r.chosen_cap_bytes / 2**20:.2f}",
                     *(_ms(s.exposed_overhead_s) for s in by.values() if s.variant != "compute-only"),
                     _ms(r.auto_minus_default_s), "-" if interval is None else f"{_ms(interval[0])}..{_ms(interval[1])}"])
    return cli.format_table(["model", "s MB", "auto cap MB", "auto ms", "25MB ms", "torch ms", "auto-25MB ms",
                             "95% interval"], rows)


def build_parser() -> cli.Parser:
    """The flags, generated from FamilySetting, plus --out and --tag."""
    parser = cli.Parser(FamilySetting, __doc__)
    parser.add_output(f"{FamilyRecord.KIND}.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    setting, args = parser.parse_settings(argv)
    try:
        out = parser.output_path(args, FamilyRecord.KIND)
    except ValueError as e:  # a bad BENCH_MACHINE_TAG
        parser.error(str(e))
    try:
        run: FamilyRun = run_family_benchmark(setting)
    except Interrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        return e.exit_status
    if run.rank != 0:
        return 0  # every rank holds the same (slowest-rank) figures; rank 0 writes them
    environment = collect_environment(setting.backend_name, run.world_size, setting.device, run.shared_gpu)
    notes = {"threads_per_rank": run.threads_per_rank}
    write_results(out, ResultsFile(FamilyRecord.KIND, environment, to_json(setting), run.records, notes))
    print(f"{run.world_size} ranks, {setting.backend_name}, {run.threads_per_rank} threads per rank; "
          "exposed overhead = step - compute-only step, median over rounds")
    print(format_records(run.records))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
