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
from cs336_systems.bench.script import BenchmarkScript
from cs336_systems.bench.step import StepRecord, StepSetting, run_step_benchmark


def _ms(seconds: float | None) -> str | None:
    return None if seconds is None else f"{1e3 * seconds:.1f}"


def format_records(records: list[StepRecord]) -> str:
    """The console table: one row per variant."""
    rows = [[r.variant, _ms(r.median_step_s), _ms(r.median_sync_s), _ms(r.exposed_overhead_s),
             f"{r.exposed_share:.1%}", f"{r.tokens_per_s:.0f}",
             None if r.allreduce_calls_per_step is None else f"{r.allreduce_calls_per_step:g}"]
            for r in records]
    return cli.format_table(["variant", "step ms", "sync ms", "exposed ms", "share", "tok/s", "calls"], rows)


SCRIPT = BenchmarkScript(StepSetting, StepRecord.KIND, __doc__, lambda setting: run_step_benchmark(setting), format_records)
build_parser, main = SCRIPT.build_parser, SCRIPT.main


if __name__ == "__main__":
    sys.exit(main())
