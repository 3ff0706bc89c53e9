"""A minimal rank script for the launcher tests: all-reduce each rank's number, write what it saw.

Run as ``allreduce_probe.py OUT_DIR [--world-size N]``, however launched (plain python spawns
N ranks; torchrun and submit_slurm.py make this process one rank). Rank r contributes r + 1,
and writes ``OUT_DIR/rank<r>.json`` with its rank facts and the reduced sum.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cs336_systems.launch import RankContext, run_ranks


def _report(ctx: RankContext, out_dir: str) -> None:
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    facts = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "local_rank": ctx.local_rank,
        "backend": ctx.backend,
        "reduced_sum": value.item(),
    }
    (Path(out_dir) / f"rank{ctx.rank}.json").write_text(json.dumps(facts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args(argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    run_ranks(_report, args.world_size, args=(args.out_dir,), device_type="cpu", timeout_s=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
