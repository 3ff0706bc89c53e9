"""Problems 3, 4, 5a and 6a: time training steps of every DDP variant beside torch's DDP.

Runs compute-only, naive, flat, per-parameter, bucketed (one per --bucket-sizes-mb) and
torch.nn.parallel.DistributedDataParallel in one process group, interleaved round by round,
and writes one JSON record per variant (median step time, time in gradient synchronisation,
exposed overhead, tokens/s, all-reduce calls per step) with the setting and environment.

Three ways to run it:

    # plain command: spawns the ranks on this machine (gloo on CPU by default)
    python scripts/bench_ddp.py --model-size cpu-small --world-size 2

    # under torchrun: one process per rank, rendezvous from the environment
    torchrun --nproc-per-node 2 scripts/bench_ddp.py --device cuda --model-size xl --context-length 128

    # on a SLURM cluster through submitit (nodes x GPUs per node ranks)
    python scripts/submit_slurm.py --nodes 1 --gpus-per-node 2 -- scripts/bench_ddp.py --device cuda --model-size xl
"""

from __future__ import annotations

import argparse
import os
import sys

from cs336_systems.ddp_benchmark import (
    ABLATION_VARIANTS,
    StepBenchmarkSetting,
    run_step_benchmark,
    setting_record,
)
from cs336_systems.launch import running_under_launcher
from cs336_systems.run_metadata import collect_environment, results_dir, write_results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = StepBenchmarkSetting()
    p.add_argument("--model-size", default=d.model_size)
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument("--global-batch", type=int, default=d.global_batch)
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--device", choices=["cpu", "cuda"], default=d.device_type)
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    p.add_argument("--bucket-sizes-mb", type=float, nargs="*", default=list(d.bucket_sizes_mb))
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--steps-per-round", type=int, default=d.steps_per_round)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--rebuild-each-round", action="store_true",
                   help="build, warm up and drop our wrappers within each round, so that only one "
                        "wrapper's gradient buffers exist at a time (large models)")
    p.add_argument("--no-torch-ddp", action="store_true", help="leave torch's DDP out")
    p.add_argument("--variants", nargs="*", default=None,
                   help="explicit variants, e.g. compute-only bucketed-25MB-copy torch-ddp")
    p.add_argument("--ablation", action="store_true",
                   help="the bucketed-DDP lever ablation (writes ablation.json by default)")
    p.add_argument("--shared-gpu", action="store_true", help="mark records: ranks share one GPU")
    p.add_argument("--tag", default=None, help="results folder name (default: machine tag)")
    p.add_argument("--out", default=None, help="output JSON (default: writeup/results/<tag>/ddp_step.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setting = StepBenchmarkSetting(
        model_size=args.model_size,
        context_length=args.context_length,
        global_batch=args.global_batch,
        world_size=args.world_size,
        device_type=args.device,
        backend=args.backend,
        bucket_sizes_mb=tuple(args.bucket_sizes_mb),
        include_torch_ddp=not args.no_torch_ddp,
        variants=ABLATION_VARIANTS if args.ablation else (tuple(args.variants) if args.variants else None),
        rounds=args.rounds,
        steps_per_round=args.steps_per_round,
        warmup_steps=args.warmup_steps,
        rebuild_each_round=args.rebuild_each_round,
    )
    try:
        records, n_parameters = run_step_benchmark(setting)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if running_under_launcher() and os.environ["RANK"] != "0":
        return 0  # every rank holds the same (slowest-rank) figures; rank 0 writes them
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    meta = collect_environment(backend, setting.world_size, setting.device_type)
    meta.update(setting=setting_record(setting), n_parameters=n_parameters, shared_gpu=args.shared_gpu)
    for record in records:
        record["shared_gpu"] = args.shared_gpu
    out = args.out or results_dir(args.tag) / ("ablation.json" if args.ablation else "ddp_step.json")
    write_results(out, records, meta)
    print(f"{setting.model_size} ({n_parameters / 1e6:.1f}M parameters), {setting.world_size} ranks, "
          f"{backend}, global batch {setting.global_batch} x {setting.context_length} tokens")
    print(f"{'variant':<18} {'step ms':>9} {'sync ms':>9} {'exposed ms':>11} {'share':>6} {'tok/s':>9} {'calls':>6}")
    for r in records:
        sync = f"{1e3 * r['median_sync_s']:.1f}" if r["median_sync_s"] is not None else "-"
        calls = f"{r['allreduce_calls_per_step']:g}" if r["allreduce_calls_per_step"] is not None else "-"
        print(f"{r['variant']:<18} {1e3 * r['median_step_s']:>9.1f} {sync:>9} "
              f"{1e3 * r['exposed_overhead_s']:>11.1f} {r['exposed_share']:>6.1%} "
              f"{r['tokens_per_s']:>9.0f} {calls:>6}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
