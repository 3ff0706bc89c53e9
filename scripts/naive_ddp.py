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
from cs336_systems.launch import Interrupted
from cs336_systems.results.environment import collect_environment
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import results_path
from cs336_systems.results.schema import to_json


def build_parser() -> cli.Parser:
    """The flags, generated from EquivalenceSetting, plus --out and --tag."""
    parser = cli.Parser(EquivalenceSetting, __doc__)
    parser.add_output(f"{EquivalenceRecord.KIND}.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    setting, args = parser.parse_settings(argv)
    try:
        out = args.out or results_path(EquivalenceRecord.KIND, args.tag)
    except ValueError as e:  # a bad BENCH_MACHINE_TAG
        parser.error(str(e))
    try:
        record = compare_with_single_process(setting)
    except Interrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        return e.exit_status
    print(
        f"{setting.variant} DDP, {setting.world_size} gloo ranks, {setting.steps} steps, global batch "
        f"{setting.global_batch}: max |DDP - single-process| = {record.max_abs_diff:.3e} (atol {setting.atol:g}); "
        f"ranks bitwise identical: {record.ranks_identical} -> {'MATCH' if record.match else 'MISMATCH'}"
    )
    environment = collect_environment("gloo", setting.world_size, "cpu")
    write_results(out, ResultsFile(EquivalenceRecord.KIND, environment, to_json(setting), [record]))
    print(f"wrote {out}")
    return 0 if record.match else 1


if __name__ == "__main__":
    sys.exit(main())
