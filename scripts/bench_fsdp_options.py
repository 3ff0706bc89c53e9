"""Each FSDP option on our FSDP beside torch's fully_shard configured the same way, in one run.

Options (cs336_systems/bench/fsdp/options.py): defaults, reshard_after_forward=False, gradient
accumulation over 4 micro-batches under no_sync, activation checkpointing per block, bf16
compute with fp32 or bf16 reduction, and hybrid sharding (world sizes 4, 6, ...). Interleaved
rounds; per option the median per-round ratio of our step time to torch's with its 95%
interval, bytes held per rank, the step's peak and activation part, collectives per step, and
what our FSDP's step was predicted to move and hold. Writes
writeup/results/<tag>/fsdp_options.json. See cs336_systems/bench/fsdp/options_run.py.

    # plain command: spawns the ranks on this machine (gloo on CPU by default)
    python scripts/bench_fsdp_options.py --model-size cpu-small --world-size 2 --global-batch 8 --rounds 6

    # under torchrun: one process per rank
    torchrun --nproc-per-node 4 scripts/bench_fsdp_options.py --device cuda --model-size medium --global-batch 16

    # on a SLURM cluster through submitit
    python scripts/submit_slurm.py --nodes 1 --gpus-per-node 4 -- scripts/bench_fsdp_options.py --device cuda
"""

from __future__ import annotations

import sys

from cs336_systems import cli
from cs336_systems.bench.fsdp.options_run import FsdpOptionRecord, FsdpOptionsSetting, run_fsdp_options_benchmark
from cs336_systems.bench.script import workload_line, write_and_report


def build_parser() -> cli.Parser:
    """The flags, generated from FsdpOptionsSetting, plus --out and --tag."""
    return cli.Parser(FsdpOptionsSetting, __doc__, results_kind=FsdpOptionRecord.KIND)


def format_records(records: list[FsdpOptionRecord]) -> str:
    """The console table: one row per option."""
    header = ["option", "ours ms", "torch ms", "ratio [95%]", "held MB ours/torch", "peak MB ours/torch",
              "activ MB ours/torch"]
    rows = []
    for r in records:
        rows.append([r.option, cli.in_ms(r.ours_median_s), cli.in_ms(r.torch_median_s),
                     cli.ratio_cell(r.ratio_median, r.ratio_ci95),
                     f"{cli.in_mb(r.ours_resident_bytes)}/{cli.in_mb(r.torch_resident_bytes)}",
                     f"{cli.in_mb(r.ours_peak_bytes)}/{cli.in_mb(r.torch_peak_bytes)}",
                     f"{cli.in_mb(r.ours_activation_peak_bytes)}/{cli.in_mb(r.torch_activation_peak_bytes)}"])
    return cli.format_table(header, rows)


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, out = build_parser().parse_with_output(argv)
    run = run_fsdp_options_benchmark(setting)
    report = f"{workload_line(setting, run.n_parameters, run.world_size)}\n{format_records(run.records)}"
    return write_and_report(out, FsdpOptionRecord.KIND, setting, run, report)


if __name__ == "__main__":
    sys.exit(main())
