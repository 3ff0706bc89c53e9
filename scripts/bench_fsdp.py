"""FSDP against DDP, ZeRO-1 and torch's FSDP: step time, memory per rank, bytes moved.

Trains the Transformer LM with bucketed DDP, DDP + ZeRO-1, our FSDP (reduce-scatter mode) and
torch.distributed.fsdp.fully_shard in one process group, each on its own model copy, interleaved
round by round, and writes one record per configuration to writeup/results/<tag>/fsdp_step.json:
median step time (slowest rank) with the paired difference from our FSDP and its 95% interval,
peak memory per rank split into parameters, gradients, optimizer state and activations, bytes
all-gathered / reduce-scattered / all-reduced / broadcast per step beside the formulas, the
largest model each would fit here, and a traced step of each FSDP for the timeline.
See cs336_systems/bench/fsdp.

Three ways to run it:

    # plain command: spawns the ranks on this machine (gloo on CPU by default)
    python scripts/bench_fsdp.py --model-size cpu-small --world-size 2 --rounds 6

    # under torchrun: one process per rank, rendezvous from the environment
    torchrun --nproc-per-node 2 scripts/bench_fsdp.py --device cuda --model-size xl --context-length 128

    # on a SLURM cluster through submitit (nodes x GPUs per node ranks)
    python scripts/submit_slurm.py --nodes 1 --gpus-per-node 2 -- scripts/bench_fsdp.py --device cuda --model-size xl
"""

from __future__ import annotations

import sys

from cs336_systems import cli
from cs336_systems.bench.script import workload_line, write_and_report
from cs336_systems.bench.fsdp import FsdpSetting, FsdpStepRecord, run_fsdp_benchmark


def build_parser() -> cli.Parser:
    """The flags, generated from FsdpSetting, plus --out and --tag."""
    return cli.Parser(FsdpSetting, __doc__, results_kind=FsdpStepRecord.KIND)


def format_records(records: list[FsdpStepRecord]) -> str:
    """The console table: one row per configuration."""
    header = ["config", "step ms", "vs fsdp ms [95%]", "peak MB", "params", "grads", "optim", "activ",
              "traffic MB", "formula MB", "fits"]
    rows = []
    for r in records:
        interval = r.vs_fsdp_ci95_s
        vs = None if r.vs_fsdp_s is None else cli.in_ms(r.vs_fsdp_s) + (
            f" [{cli.in_ms(interval[0])}, {cli.in_ms(interval[1])}]" if interval else "")
        rows.append([r.configuration, cli.in_ms(r.median_step_s), vs, cli.in_mb(r.peak_bytes),
                     *(cli.in_mb(v) for v in r.peak_parts.values()), cli.in_mb(r.traffic_bytes),
                     cli.in_mb(r.formula_traffic_bytes), f"{r.largest_parameters / 1e6:.0f}M ({r.largest_model_size or '-'})"])
    return cli.format_table(header, rows)


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, out = build_parser().parse_with_output(argv)
    run = run_fsdp_benchmark(setting)
    report = f"{workload_line(setting, run.n_parameters, run.world_size)}\n{format_records(run.records)}"
    return write_and_report(out, FsdpStepRecord.KIND, setting, run, report)


if __name__ == "__main__":
    sys.exit(main())
