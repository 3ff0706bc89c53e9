"""Problem 1: time all-reduce over backends, world sizes and payload sizes, within a time budget.

For each backend x world size (one process group each) and payload, reports the slowest rank's
median time per all-reduce with its spread, algbw and busbw (nccl-tests' definitions, GB/s =
1e9 B/s; MB = 2**20 B) and whether the reduced values were right. Settings that would overrun
the budget or memory are skipped and recorded with the reason. Results and the environment go
to writeup/results/<machine tag>/allreduce.json (or --out). The measurement lives in
cs336_systems/bench/allreduce/.

Three ways to run it:

    # plain command: spawns the ranks on this machine (here: gloo on CPU, the full grid in ~5 min)
    python scripts/bench_allreduce.py --backend gloo --device cpu --world-sizes 2 4 6 --sizes-mb 1 10 100 1000

    # under torchrun: one process per rank; the world size is torchrun's, one backend per job
    torchrun --nproc-per-node 4 scripts/bench_allreduce.py --backend nccl --device cuda --sizes-mb 1 10 100 1000

    # on a SLURM cluster through submitit (nodes x GPUs per node ranks)
    python scripts/submit_slurm.py --nodes 1 --gpus-per-node 4 -- scripts/bench_allreduce.py --backend nccl --device cuda
"""

from __future__ import annotations

import sys
import time

from cs336_systems import cli
from cs336_systems.bench.allreduce import (
    AllReduceRecord,
    AllReduceSetting,
    console_table,
    is_writer_process,
    run_allreduce_benchmark,
)
from cs336_systems.results.environment import collect_environment
from cs336_systems.results.files import save_results


def build_parser() -> cli.Parser:
    """The flags, generated from AllReduceSetting, plus --out and --tag."""
    return cli.Parser(AllReduceSetting, __doc__, results_kind=AllReduceRecord.KIND)


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, out = build_parser().parse_with_output(argv)
    start = time.monotonic()
    records = run_allreduce_benchmark(setting)
    wall_s = time.monotonic() - start
    if not is_writer_process():
        return 0
    world_sizes = sorted({r.world_size for r in records})
    environment = collect_environment(
        ",".join(setting.backends), max(world_sizes), setting.device,
        shared_gpu=all(r.shared_gpu for r in records),
    )
    notes = {"wall_s": wall_s, "world_sizes_run": world_sizes}
    save_results(out, AllReduceRecord.KIND, setting, records, environment, notes)
    print(console_table(records))
    skipped = sum(not r.measured for r in records)
    print(f"{len(records)} settings ({skipped} skipped) in {wall_s:.1f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
