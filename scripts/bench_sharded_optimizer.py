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
from cs336_systems.bench.accounting import (
    PHASES,
    AccountingRecord,
    AccountingRun,
    AccountingSetting,
    communication_bytes_per_rank,
    run_accounting,
    sharded_minus_unsharded,
)
from cs336_systems.results.environment import collect_environment
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.schema import to_json
from cs336_systems.units import MB


def _mb(n_bytes: float | None) -> str | None:
    return None if n_bytes is None else f"{n_bytes / MB:.1f}"


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def format_records(records: list[AccountingRecord]) -> str:
    """The console table: one row per (configuration, rank); memory in MB above the baseline."""
    rows = [[r.configuration, r.rank, _mb(r.baseline_bytes), _mb(r.optimizer_state_bytes),
             _mb(r.expected_optimizer_state_bytes), *(_mb(r.phase(p).peak_above_baseline_bytes) for p in PHASES),
             _ms(r.median_step_s), _ms(r.median_optimizer_step_s)] for r in records]
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
            f"95% interval {_ms(interval[0])} to {_ms(interval[1])} ms")
        parts.append(f"{label} {_ms(median)} ms ({spread})")
    return "sharded minus unsharded, median over rounds: " + "; ".join(parts)


def build_parser() -> cli.Parser:
    """The flags, generated from AccountingSetting, plus --out and --tag."""
    parser = cli.Parser(AccountingSetting, __doc__)
    parser.add_output(f"{AccountingRecord.KIND}.json")
    return parser


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    setting, args = parser.parse_settings(argv)
    try:
        out = parser.output_path(args, AccountingRecord.KIND)
    except ValueError as e:  # a bad BENCH_MACHINE_TAG
        parser.error(str(e))
    run: AccountingRun = run_accounting(setting)
    if run.rank != 0:
        return 0  # every rank gathered every record; rank 0 writes them
    first = run.records[0]
    environment = collect_environment(setting.backend_name, run.world_size, setting.device, run.shared_gpu)
    notes = {"n_parameters": first.n_parameters}
    write_results(out, ResultsFile(AccountingRecord.KIND, environment, to_json(setting), run.records, notes))
    print(f"{setting.model_size} ({first.n_parameters / 1e6:.1f}M parameters), {run.world_size} ranks, "
          f"{setting.backend_name}, global batch {setting.global_batch} x {setting.context_length} tokens; "
          f"memory in MB above each configuration's baseline ({first.method})")
    print(format_records(run.records))
    print(format_difference(run.records))
    comm = communication_bytes_per_rank(first.parameter_bytes, run.world_size)
    print(f"per rank per step: DDP all-reduce {_mb(comm.ddp_allreduce)} MB, sharded-optimizer broadcasts "
          f"{_mb(comm.sharded_optimizer_broadcast)} MB (together {_mb(comm.ddp_plus_sharded_optimizer)}), "
          f"paper ZeRO-1 {_mb(comm.paper_zero1)} MB")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
