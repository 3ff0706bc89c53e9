"""Problem optimizer_state_sharding_accounting: memory and step time with and without ZeRO-1.

Trains the Transformer LM data-parallel with plain AdamW on every rank ("unsharded") and with
ShardedOptimizer over AdamW ("sharded"), in one process group, and writes one record per
(configuration, rank) to writeup/results/<tag>/sharded_optimizer.json: peak and current memory
after the model is built, after initialisation, directly before and directly after the
optimizer step, each broken down into parameters, gradients, optimizer state and the rest; the
optimizer state against its formula; bytes received by the broadcasts; and step times, slowest
rank, from rounds that alternate the two configurations. On a CPU memory is the process RSS, on
a GPU the CUDA allocator's count (each record's "method"). See cs336_systems/bench/accounting.

Three ways to run it:

    # plain command: spawns the ranks on this machine (gloo on CPU)
    python scripts/bench_sharded_optimizer.py --model-size cpu-small --world-size 2 --global-batch 4

    # under torchrun: one process per rank, rendezvous from the environment
    torchrun --nproc-per-node 2 scripts/bench_sharded_optimizer.py --device cuda --model-size xl --global-batch 8

    # on a SLURM cluster through submitit (nodes x GPUs per node ranks)
    python scripts/submit_slurm.py --nodes 1 --gpus-per-node 2 -- scripts/bench_sharded_optimizer.py --device cuda --model-size xl
"""

from __future__ import annotations

import sys

from cs336_systems import cli
from cs336_systems.bench.script import workload_line, write_and_report
from cs336_systems.bench.accounting import PHASES, AccountingRecord, AccountingRun, AccountingSetting, run_accounting
from cs336_systems.bench.accounting import communication_bytes_per_rank, sharded_minus_unsharded


def build_parser() -> cli.Parser:
    """The flags, generated from AccountingSetting, plus --out and --tag."""
    return cli.Parser(AccountingSetting, __doc__, results_kind=AccountingRecord.KIND)


def format_records(records: list[AccountingRecord]) -> str:
    """The console table: one row per (configuration, rank); memory in MB above the baseline."""
    rows = [[r.configuration, r.rank, cli.in_mb(r.baseline_bytes), cli.in_mb(r.optimizer_state_bytes),
             cli.in_mb(r.expected_optimizer_state_bytes), *(cli.in_mb(r.phase(p).peak_above_baseline_bytes) for p in PHASES),
             cli.in_ms(r.median_step_s), cli.in_ms(r.median_optimizer_step_s)] for r in records]
    header = ["configuration", "rank", "baseline", "state", "expected", *(f"peak {p}" for p in PHASES),
              "step ms", "opt ms"]
    return cli.format_table(header, rows)


def format_difference(records: list[AccountingRecord]) -> str:
    """Sharded minus unsharded, paired round by round, with its 95% interval."""
    parts = []
    for label, times in (("step", "step_times_s"), ("optimizer.step()", "optimizer_step_times_s")):
        found = sharded_minus_unsharded(records, times)
        if found is None:
            continue
        median, interval = found
        spread = "no interval: fewer than 6 rounds" if interval is None else (
            f"95% interval {cli.in_ms(interval[0])} to {cli.in_ms(interval[1])} ms")
        parts.append(f"{label} {cli.in_ms(median)} ms ({spread})")
    return "sharded minus unsharded, median over rounds: " + "; ".join(parts)


def report(setting: AccountingSetting, run: AccountingRun) -> str:
    """The console report: the setting in one line, then the table."""
    first = run.records[0]
    comm = communication_bytes_per_rank(first.parameter_bytes, run.world_size)
    return "\n".join([
        workload_line(setting, first.n_parameters, run.world_size)
        + f"; memory in MB above each configuration's baseline ({first.method})",
        format_records(run.records),
        format_difference(run.records),
        f"per rank per step: DDP all-reduce {cli.in_mb(comm.ddp_allreduce)} MB, sharded-optimizer broadcasts "
        f"{cli.in_mb(comm.sharded_optimizer_broadcast)} MB (together {cli.in_mb(comm.ddp_plus_sharded_optimizer)}), "
        f"paper ZeRO-1 {cli.in_mb(comm.paper_zero1)} MB",
    ])


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, out = build_parser().parse_with_output(argv)
    run = run_accounting(setting)
    return write_and_report(out, AccountingRecord.KIND, setting, run, report(setting, run))


if __name__ == "__main__":
    sys.exit(main())
