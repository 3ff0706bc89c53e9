"""Problem 2: show that naive DDP trains to the same weights as single-process training.

Spawns N gloo ranks on this machine, trains a toy model with naive DDP on random data, trains
the same model in one process on the whole batch, and exits non-zero unless every parameter
matches (within --atol) after every step. Prints the largest difference.

    python scripts/naive_ddp.py                      # 2 ranks, 10 steps
    python scripts/naive_ddp.py --world-size 4 --steps 20 --variant flat
    python scripts/naive_ddp.py --out writeup/results/<tag>/naive_ddp.json   # keep the result
"""

from __future__ import annotations

import argparse
import sys

from dataclasses import asdict

from cs336_systems.equivalence import VARIANTS, EquivalenceSetting, compare_with_single_process
from cs336_systems.run_metadata import collect_environment, write_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="naive")
    # float32 rounding of per-rank partial sums is ~1e-7; a wrong gradient is ~1e-2.
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("--out", default=None, help="also write the result as a JSON results file")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error(f"--world-size must be at least 2, got {args.world_size}")
    setting = EquivalenceSetting(args.variant, args.world_size, args.steps, args.batch_size, args.seed)
    try:
        report = compare_with_single_process(setting)
    except ValueError as e:
        parser.error(str(e))
    ok = report.max_abs_diff <= args.atol and report.ranks_identical
    print(
        f"{args.variant} DDP, {args.world_size} gloo ranks, {args.steps} steps, batch {args.batch_size}: "
        f"max |DDP - single-process| = {report.max_abs_diff:.3e} (atol {args.atol:g}); "
        f"ranks bitwise identical: {report.ranks_identical} -> {'MATCH' if ok else 'MISMATCH'}"
    )
    if args.out:
        record = {
            **asdict(setting),
            "atol": args.atol,
            "max_abs_diff": report.max_abs_diff,
            "max_abs_diff_per_step": report.max_abs_diff_per_step,
            "ranks_identical": report.ranks_identical,
            "match": ok,
        }
        write_results(args.out, [record], collect_environment("gloo", args.world_size, "cpu"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
