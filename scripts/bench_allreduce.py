"""Problem 1: time all-reduce over backends, world sizes and payload sizes, within a time budget.

For each backend x world size (one process group each) and payload, reports the slowest rank's
median time per all-reduce with its spread, algbw and busbw (nccl-tests' definitions, GB/s =
1e9 B/s; MB = 2**20 B) and whether the reduced values were right. Settings that would overrun
the budget or memory are skipped and recorded with the reason. Results and the environment go
to writeup/results/<machine tag>/allreduce.json.

Three ways to run it:

    # plain command: spawns the ranks on this machine (here: gloo on CPU, the full grid in ~5 min)
    python scripts/bench_allreduce.py --backend gloo --device cpu --world-sizes 2 4 6 --sizes-mb 1 10 100 1000

    # under torchrun: one process per rank; the world size is torchrun's, one backend per job
    torchrun --nproc-per-node 4 scripts/bench_allreduce.py --backend nccl --device cuda --sizes-mb 1 10 100 1000

    # on a SLURM cluster through submitit (nodes x GPUs per node ranks)
    python scripts/submit_slurm.py --nodes 1 --gpus-per-node 4 -- scripts/bench_allreduce.py --backend nccl --device cuda
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from cs336_systems.allreduce_benchmark import (
    DEFAULT_MEMORY_FRACTION,
    DEFAULT_TIMED_ITERS,
    DEFAULT_WARMUP_ITERS,
    FLOAT32_BYTES,
    MB,
    run_allreduce_benchmark,
)
from cs336_systems.launch import running_under_launcher
from cs336_systems.run_metadata import collect_environment, results_dir, write_results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["gloo", "nccl", "both"], default=None,
                   help="default: nccl with --device cuda, gloo with --device cpu")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the payload lives")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 10, 100, 1000],
                   help="payloads, MB = 2**20 B")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP_ITERS, help="untimed all-reduces per payload")
    p.add_argument("--iters", type=int, default=DEFAULT_TIMED_ITERS, help="timed all-reduces per payload")
    p.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget for the whole grid")
    p.add_argument("--memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION,
                   help="share of free RAM (CPU) or GPU memory all ranks' buffers may take")
    p.add_argument("--tag", default=None, help="results folder name (default: the machine tag)")
    p.add_argument("--out", default=None, help="output JSON (default: writeup/results/<tag>/allreduce.json)")
    return p.parse_args(argv)


def payload_bytes(size_mb: float) -> int:
    """MB to bytes, rounded down to whole float32 elements."""
    size = int(size_mb * MB) // FLOAT32_BYTES * FLOAT32_BYTES
    if size <= 0:
        raise ValueError(f"payload of {size_mb} MB holds no float32 element")
    return size


def format_table(records: list[dict]) -> str:
    header = (f"{'backend':<7} {'ranks':>5} {'MB':>7} {'iters':>5} {'median ms':>10} {'p10-p90 ms':>19} "
              f"{'algbw':>8} {'busbw':>8}  check")
    lines = [header, f"{'':<35}{'':>20} {'GB/s':>8} {'GB/s':>8}"]
    for r in records:
        head = f"{r['backend']:<7} {r['world_size']:>5} {r['payload_mb']:>7g}"
        if r["skipped"]:
            lines.append(f"{head} {'-':>5} skipped: {r['reason']}")
            continue
        spread = f"{r['p10_s'] * 1e3:.3f}-{r['p90_s'] * 1e3:.3f}"
        check = "ok" if r["correct"] else "WRONG"
        if r["shared_gpu"]:
            check += " (shared GPU)"
        lines.append(f"{head} {r['timed_iters']:>5} {r['median_s'] * 1e3:>10.3f} {spread:>19} "
                     f"{r['algbw_gbps']:>8.3f} {r['busbw_gbps']:>8.3f}  {check}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.backend == "both":
        backends = ["gloo", "nccl"]
    else:
        backends = [args.backend or ("nccl" if args.device == "cuda" else "gloo")]
    start = time.monotonic()
    try:
        sizes = [payload_bytes(mb) for mb in args.sizes_mb]
        records = run_allreduce_benchmark(
            backends,
            args.world_sizes,
            sizes,
            warmup=args.warmup,
            iters=args.iters,
            budget_s=args.budget_s,
            device_type=args.device,
            memory_fraction=args.memory_fraction,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wall_s = time.monotonic() - start
    if running_under_launcher() and os.environ["RANK"] != "0":
        return 0  # every rank holds the same records; rank 0 writes them
    world_sizes = sorted({r["world_size"] for r in records})
    meta = collect_environment(",".join(backends), max(world_sizes), args.device)
    meta.update(
        benchmark="allreduce",
        world_sizes=world_sizes,
        payload_bytes=sorted(set(sizes)),
        warmup_iters=args.warmup,
        timed_iters=args.iters,
        budget_s=args.budget_s,
        memory_fraction=args.memory_fraction,
        wall_s=wall_s,
        units={"time": "s", "bandwidth": "GB/s = 1e9 bytes/s", "payload_mb": "MB = 2**20 bytes"},
    )
    out = args.out or results_dir(args.tag) / "allreduce.json"
    write_results(out, records, meta)
    print(format_table(records))
    skipped = sum(r["skipped"] for r in records)
    print(f"{len(records)} settings ({skipped} skipped) in {wall_s:.1f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
