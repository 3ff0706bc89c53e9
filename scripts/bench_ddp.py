"""Problems 3, 4, 5a and 6a: time training steps of every DDP variant beside torch's DDP.

Runs compute-only, naive, flat, per-parameter, bucketed (one per --bucket-sizes-mb) and
torch.nn.parallel.DistributedDataParallel in one process group, interleaved round by round,
and writes one record per variant (median step time, time in gradient synchronisation,
exposed overhead with its 95% interval, tokens/s, all-reduce calls per step) with the setting
and environment to writeup/results/<tag>/ddp_step.json; --ablation times the bucketed-DDP
levers instead and writes ddp_step-ablation.json.

Three ways to run it:

    # plain command: spawns the ranks on this machine (gloo on CPU by default)
    python scripts/bench_ddp.py --model-size cpu-small --world-size 2

    # under torchrun: one process per rank, rendezvous from the environment
    torchrun --nproc-per-node 2 scripts/bench_ddp.py --device cuda --model-size xl --context-length 128

    # on a SLURM cluster through submitit (nodes x GPUs per node ranks)
    python scripts/submit_slurm.py --nodes 1 --gpus-per-node 2 -- scripts/bench_ddp.py --device cuda --model-size xl
"""

from __future__ import annotations

import sys

from cs336_systems import cli
from cs336_systems.bench.script import workload_line, write_and_report
from cs336_systems.bench.step import StepRecord, StepSetting, run_step_benchmark


def build_parser() -> cli.Parser:
    """The flags, generated from StepSetting, plus --out and --tag."""
    return cli.Parser(StepSetting, __doc__, results_kind=StepRecord.KIND)


def format_records(records: list[StepRecord]) -> str:
    """The console table: one row per variant."""
    rows = [[r.variant, cli.in_ms(r.median_step_s), cli.in_ms(r.median_sync_s), cli.in_ms(r.exposed_overhead_s),
             f"{r.exposed_share:.1%}", f"{r.tokens_per_s:.0f}",
             None if r.allreduce_calls_per_step is None else f"{r.allreduce_calls_per_step:g}"]
            for r in records]
    return cli.format_table(["variant", "step ms", "sync ms", "exposed ms", "share", "tok/s", "calls"], rows)


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, out = build_parser().parse_with_output(argv)
    run = run_step_benchmark(setting)
    report = (f"{workload_line(setting, run.n_parameters, run.world_size)}; exposed = step - compute-only step, "
              f"median over rounds, paired round by round\n{format_records(run.records)}")
    return write_and_report(out, StepRecord.KIND, setting, run, report)


if __name__ == "__main__":
    sys.exit(main())
