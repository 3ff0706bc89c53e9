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
from cs336_systems.bench.script import BenchmarkScript
from cs336_systems.bench.fsdp import FsdpSetting, FsdpStepRecord, run_fsdp_benchmark
from cs336_systems.units import MB


def _ms(seconds: float | None) -> str | None:
    return None if seconds is None else f"{1e3 * seconds:.1f}"


def _mb(n_bytes: float) -> str:
    return f"{n_bytes / MB:.1f}"


def format_records(records: list[FsdpStepRecord]) -> str:
    """The console table: one row per configuration."""
    rows = []
    for r in records:
        interval = r.vs_fsdp_ci95_s
        vs = None if r.vs_fsdp_s is None else _ms(r.vs_fsdp_s) + (
            f" [{_ms(interval[0])}, {_ms(interval[1])}]" if interval else "")
        rows.append([r.configuration, _ms(r.median_step_s), vs, _mb(r.peak_bytes),
                     *(_mb(v) for v in r.peak_parts.values()), _mb(r.traffic_bytes), _mb(r.formula_traffic_bytes),
                     f"{r.largest_parameters / 1e6:.0f}M ({r.largest_model_size or '-'})"])
    header = ["config", "step ms", "vs fsdp ms [95%]", "peak MB", "params", "grads", "optim", "activ",
              "traffic MB", "formula MB", "fits"]
    return cli.format_table(header, rows)


SCRIPT = BenchmarkScript(FsdpSetting, FsdpStepRecord.KIND, __doc__, lambda setting: run_fsdp_benchmark(setting), format_records)
build_parser, main = SCRIPT.build_parser, SCRIPT.main


if __name__ == "__main__":
    sys.exit(main())
