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
from cs336_systems.bench.script import write_and_report
from cs336_systems.bench.family import FamilyRecord, FamilySetting, run_family_benchmark
from cs336_systems.bench.step import COMPUTE_ONLY
from cs336_systems.units import MB


def build_parser() -> cli.Parser:
    """The flags, generated from FamilySetting, plus --out and --tag."""
    return cli.Parser(FamilySetting, __doc__, results_kind=FamilyRecord.KIND)


def format_records(records: list[FamilyRecord]) -> str:
    """The console table: one row per model."""
    rows = []
    for r in records:
        interval = r.auto_minus_default_ci95_s
        rows.append([r.model, cli.in_mb(r.gradient_bytes), f"{r.chosen_cap_bytes / MB:.2f}",
                     *(cli.in_ms(s.exposed_overhead_s) for s in r.steps if s.variant != COMPUTE_ONLY),
                     cli.in_ms(r.auto_minus_default_s),
                     None if interval is None else f"{cli.in_ms(interval[0])}..{cli.in_ms(interval[1])}"])
    return cli.format_table(["model", "s MB", "auto cap MB", "auto ms", "25MB ms", "torch ms", "auto-25MB ms",
                             "95% interval"], rows)


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, out = build_parser().parse_with_output(argv)
    run = run_family_benchmark(setting)
    report = "\n".join([f"{run.world_size} ranks, {setting.backend_name}, {run.threads_per_rank} threads per rank; "
                        "exposed overhead = step - compute-only step, median over rounds", format_records(run.records)])
    return write_and_report(out, FamilyRecord.KIND, setting, run, report)


if __name__ == "__main__":
    sys.exit(main())
