"""Problem 2: show that naive DDP trains to the same weights as single-process training.

Spawns N gloo ranks on this machine, trains a toy model with naive DDP on random data, trains
the same model in one process on the whole batch, and exits non-zero unless every parameter
matches (within --atol) after every step. Prints the largest difference and writes it to
writeup/results/<tag>/naive_ddp.json (or --out).

    python scripts/naive_ddp.py                      # 2 ranks, 10 steps
    python scripts/naive_ddp.py --world-size 4 --steps 20 --variant flat
    python scripts/naive_ddp.py --out /tmp/naive_ddp.json

It spawns its own ranks (it compares all of them), so it runs as a plain command only, not
under torchrun or SLURM.
"""

from __future__ import annotations

import sys

from cs336_systems import cli
from cs336_systems.bench.equivalence import EquivalenceRecord, EquivalenceSetting, compare_with_single_process
from cs336_systems.results.environment import collect_environment
from cs336_systems.results.files import save_results


def build_parser() -> cli.Parser:
    """The flags, generated from EquivalenceSetting, plus --out and --tag."""
    return cli.Parser(EquivalenceSetting, __doc__, results_kind=EquivalenceRecord.KIND)


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, out = build_parser().parse_with_output(argv)
    record = compare_with_single_process(setting)
    print(
        f"{setting.variant} DDP, {setting.world_size} gloo ranks, {setting.steps} steps, global batch "
        f"{setting.global_batch}: max |DDP - single-process| = {record.max_abs_diff:.3e} (atol {setting.atol:g}); "
        f"ranks bitwise identical: {record.ranks_identical} -> {'MATCH' if record.match else 'MISMATCH'}"
    )
    environment = collect_environment("gloo", setting.world_size, "cpu")
    save_results(out, EquivalenceRecord.KIND, setting, [record], environment)
    print(f"wrote {out}")
    return 0 if record.match else 1


if __name__ == "__main__":
    sys.exit(main())
