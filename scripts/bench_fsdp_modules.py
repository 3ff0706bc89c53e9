"""Our fully_shard beside torch's on the models FSDP2 users shard, in one run.

The six cases of cs336_systems/bench/fsdp/modules.py: nn.TransformerEncoder sharded at the root
alone and per layer, blocks around nn.MultiheadAttention, a tied embedding and head, frozen
layers, bf16 compute from float32 inputs. Interleaved rounds; per case the median per-round
ratio of our step time to torch's with its 95% interval, bytes held per rank between steps, the
step's peak, and how far the two sides' weights ended apart. Writes
writeup/results/<tag>/fsdp_modules.json at 2 ranks, fsdp_modules-ws<n>.json at n (``make bench``
runs it at 2 and 3). See cs336_systems/bench/fsdp/modules_run.py.

    # plain command: spawns the ranks on this machine (gloo on CPU by default)
    python scripts/bench_fsdp_modules.py --world-size 2 --rounds 32
    python scripts/bench_fsdp_modules.py --world-size 3 --rounds 32

    # under torchrun: one process per rank
    torchrun --nproc-per-node 2 scripts/bench_fsdp_modules.py --d-model 1024 --num-heads 16 --d-ff 4096
"""

from __future__ import annotations

import sys

from cs336_systems import cli
from cs336_systems.bench.fsdp.modules_run import FsdpModuleRecord, FsdpModulesSetting, run_fsdp_modules_benchmark
from cs336_systems.bench.script import write_and_report


def build_parser() -> cli.Parser:
    """The flags, generated from FsdpModulesSetting, plus --out and --tag."""
    return cli.Parser(FsdpModulesSetting, __doc__, results_kind=FsdpModuleRecord.KIND)


def format_records(records: list[FsdpModuleRecord]) -> str:
    """The console table: one row per case."""
    header = ["case", "params", "ours ms", "torch ms", "ratio [95%]", "held MB ours/torch", "peak MB ours/torch",
              "max |dw|"]
    rows = []
    for r in records:
        rows.append([r.case, f"{r.n_parameters / 1e6:.2f}M", cli.in_ms(r.ours_median_s), cli.in_ms(r.torch_median_s),
                     cli.ratio_cell(r.ratio_median, r.ratio_ci95),
                     f"{cli.in_mb(r.ours_resident_bytes)}/{cli.in_mb(r.torch_resident_bytes)}",
                     f"{cli.in_mb(r.ours_peak_bytes)}/{cli.in_mb(r.torch_peak_bytes)}",
                     f"{r.max_weight_difference:.1e}"])
    return cli.format_table(header, rows)


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, out = build_parser().parse_with_output(argv)
    run = run_fsdp_modules_benchmark(setting)
    line = (f"{run.world_size} ranks, {setting.backend_name}, d_model {setting.d_model}, {setting.num_layers} blocks, "
            f"global batch {setting.global_batch} x {setting.context_length} positions, {setting.rounds} rounds")
    return write_and_report(out, FsdpModuleRecord.KIND, setting, run, f"{line}\n{format_records(run.records)}")


if __name__ == "__main__":
    sys.exit(main())
