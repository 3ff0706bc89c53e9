"""Problems 3, 4, 5a and 6a: time training steps of every DDP variant beside torch's DDP.

Runs compute-only, naive, flat, per-parameter, bucketed (one per --bucket-sizes-mb) and
torch.nn.parallel.DistributedDataParallel in one process group, interleaved round by round,
and writes one record per variant (median step time, time in gradient synchronisation,
exposed overhead with its 95% interval, tokens/s, all-reduce calls per step) with the setting
and environment to writeup/results/<tag>/ddp_step.json; --ablation times the bucketed-DDP
levers instead and writes ddp_step-ablation.json.

Three ways to run it:

    # plain command: spawns the ranks on this machine (gloo on CPU by default)
    python scripts/bench_ddp.py --model-size cpu-small --world-size 2

    # under torchrun: one process per rank, rendezvous from the environment
    torchrun --nproc-per-node 2 scripts/bench_ddp.py --device cuda --model-size xl --context-length 128

    # on a SLURM cluster through submitit (nodes x GPUs per node ranks)
    python scripts/submit_slurm.py --nodes 1 --gpus-per-node 2 -- scripts/bench_ddp.py --device cuda --model-size xl
"""

from __future__ import annotations

import sys

from cs336_systems import cli
from cs336_systems.bench.step import StepRecord, StepRun, StepSetting, run_step_benchmark
from cs336_systems.launch import Interrupted
from cs336_systems.results.environment import collect_environment
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import results_path
from cs336_systems.results.schema import to_json


def _ms(seconds: float | None) -> str | None:
    return None if seconds is None else f"{1e3 * seconds:.1f}"


def format_records(records: list[StepRecord]) -> str:
    """The console table: one row per variant."""
    rows = [[r.variant, _ms(r.median_step_s), _ms(r.median_sync_s), _ms(r.exposed_overhead_s),
             f"{r.exposed_share:.1%}", f"{r.tokens_per_s:.0f}",
             None if r.allreduce_calls_per_step is None else f"{r.allreduce_calls_per_step:g}"]
            for r in records]
    return cli.format_table(["variant", "step ms", "sync ms", "exposed ms", "share", "tok/s", "calls"], rows)


def build_parser() -> cli.Parser:
    """The flags, generated from StepSetting, plus --out and --tag."""
    parser = cli.Parser(StepSetting, __doc__)
    parser.add_output(f"{StepRecord.KIND}.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    setting, args = parser.parse_settings(argv)
    try:
        out = args.out or results_path(StepRecord.KIND, args.tag, suffix=setting.tag_suffix)
    except ValueError as e:  # a bad BENCH_MACHINE_TAG
        parser.error(str(e))
    try:
        run: StepRun = run_step_benchmark(setting)
    except Interrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        return e.exit_status
    if run.rank != 0:
        return 0  # every rank holds the same (slowest-rank) figures; rank 0 writes them
    environment = collect_environment(setting.backend_name, run.world_size, setting.device, run.shared_gpu)
    write_results(out, ResultsFile(StepRecord.KIND, environment, to_json(setting), run.records, run.notes))
    print(f"{setting.model_size} ({run.n_parameters / 1e6:.1f}M parameters), {run.world_size} ranks, "
          f"{setting.backend_name}, global batch {setting.global_batch} x {setting.context_length} tokens")
    print(format_records(run.records))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
