"""A job that runs until stopped, for the signal tests: ``signal_probe.py --ready R --out O [--seconds S]``.

Two gloo ranks (spawned here, or this process is one rank under torchrun) all-reduce in a loop
for S seconds (default 60); rank 0 creates R once both are in the loop, and O (the stand-in for
a results file) is written only if the loop ran to its end. The launcher reports an interruption as the
repo's scripts do: one line, ``interrupted: ...``, and the shell's status for the signal.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cs336_systems.launch import Interrupted, RankContext, run_ranks



def _loop(ctx: RankContext, ready: str, seconds: float) -> int:
    # The last element carries "my time is not up yet"; MIN-reducing it makes every rank leave
    # the loop after the same round. (Each rank stopping on its own clock left one rank in an
    # extra all-reduce that its peer answered with the teardown barrier: a hang.)
    tensor = torch.ones(1024)
    deadline = time.monotonic() + seconds
    rounds = 0
    while True:
        tensor[-1] = float(time.monotonic() < deadline)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        if tensor[-1].item() == 0.0:
            break
        rounds += 1
        if rounds == 2 and ctx.is_main:
            Path(ready).touch()
        time.sleep(0.01)
    return rounds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ready", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    try:
        # Pinned, so that under torchrun on a GPU machine the ranks do not default to NCCL on one GPU.
        rounds = run_ranks(_loop, 2, args=(args.ready, args.seconds), backend="gloo", device_type="cpu",
                           timeout_s=120, join_timeout_s=300)
    except Interrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        return e.exit_status
    Path(args.out).write_text(f"{rounds}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
