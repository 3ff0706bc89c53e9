"""Problem optimizer_state_sharding_accounting: memory and step time with and without ZeRO-1.

Trains the Transformer LM a few data-parallel steps with plain AdamW on every rank
("unsharded"), then with ShardedOptimizer over AdamW ("sharded"), and writes one JSON record per
(configuration, rank): peak and current memory after initialisation, directly before and
directly after the optimizer step, a breakdown (parameters, gradients, optimizer state, other),
the expected optimizer state, communication volumes, and step times (slowest rank). On a CPU
memory is the process RSS, on a GPU the CUDA allocator's count (each record's "method").

Three ways to run it:

    # plain command: spawns the ranks on this machine (gloo on CPU), one launch per configuration
    python scripts/bench_sharded_optimizer.py --model-size cpu-small --world-size 2

    # under torchrun: one process per rank; both configurations run in the same processes
    torchrun --nproc-per-node 2 scripts/bench_sharded_optimizer.py --device cuda --model-size xl

    # on a SLURM cluster through submitit (nodes x GPUs per node ranks)
    python scripts/submit_slurm.py --nodes 1 --gpus-per-node 2 -- scripts/bench_sharded_optimizer.py --device cuda --model-size xl
"""

from __future__ import annotations

import argparse
import os
import sys

from cs336_systems.launch import running_under_launcher
from cs336_systems.run_metadata import collect_environment, results_dir, write_results
from cs336_systems.sharding_accounting import (
    PHASES,
    ShardingAccountingSetting,
    communication_bytes_per_rank,
    run_sharding_accounting,
    setting_record,
)

MIB = 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = ShardingAccountingSetting()
    p.add_argument("--model-size", default=d.model_size)
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument("--batch-per-rank", type=int, default=d.batch_per_rank)
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--device", choices=["cpu", "cuda"], default=d.device_type)
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--bucket-size-mb", type=float, default=d.bucket_size_mb)
    p.add_argument("--tag", default=None, help="results folder name (default: machine tag)")
    p.add_argument("--out", default=None, help="output JSON (default: writeup/results/<tag>/sharded_optimizer.json)")
    return p.parse_args(argv)


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def print_table(records: list[dict]) -> None:
    print(f"memory in MiB above each rank's baseline; method: {records[0]['method']}")
    peaks = " ".join(f"{'peak ' + phase:>18}" for phase in PHASES)
    print(f"{'configuration':<13} {'rank':>4} {'state':>8} {'expected':>9} {peaks} {'step ms':>8} {'opt ms':>7}")
    for r in records:
        peak = " ".join(f"{_mib(r['phases'][phase]['peak_above_baseline_bytes']):>18}" for phase in PHASES)
        print(f"{r['configuration']:<13} {r['rank']:>4} {_mib(r['measured_optimizer_state_bytes']):>8} "
              f"{_mib(r['expected_optimizer_state_bytes']):>9} {peak} "
              f"{1e3 * r['median_step_s']:>8.1f} {1e3 * r['median_optimizer_step_s']:>7.1f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        setting = ShardingAccountingSetting(
            model_size=args.model_size,
            context_length=args.context_length,
            batch_per_rank=args.batch_per_rank,
            world_size=args.world_size,
            device_type=args.device,
            backend=args.backend,
            steps=args.steps,
            warmup_steps=args.warmup_steps,
            bucket_size_mb=args.bucket_size_mb,
        )
        records = run_sharding_accounting(setting)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if running_under_launcher() and os.environ["RANK"] != "0":
        return 0  # every rank gathered all records; rank 0 writes them
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    first = records[0]
    # Under torchrun the launcher, not --world-size, decides how many ranks there are.
    world_size = first["world_size"]
    meta = collect_environment(backend, world_size, setting.device_type)
    meta.update(
        setting=setting_record(setting),
        n_parameters=first["n_parameters"],
        memory_method=first["method"],
        communication_bytes_per_rank=communication_bytes_per_rank(first["parameter_bytes"], world_size),
    )
    out = args.out or results_dir(args.tag) / "sharded_optimizer.json"
    write_results(out, records, meta)
    print(f"{setting.model_size} ({first['n_parameters'] / 1e6:.1f}M parameters), {world_size} ranks, "
          f"{backend}, {setting.batch_per_rank} x {setting.context_length} tokens per rank")
    print_table(records)
    comm = meta["communication_bytes_per_rank"]
    print(f"per rank per step: DDP all-reduce {_mib(comm['ddp_allreduce'])} MiB, sharded-optimizer "
          f"broadcasts {_mib(comm['sharded_optimizer_broadcast'])} MiB (together "
          f"{_mib(comm['ddp_plus_sharded_optimizer'])}), paper ZeRO-1 {_mib(comm['paper_zero1'])} MiB")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
