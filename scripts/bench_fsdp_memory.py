"""Peak memory per rank of DDP, the sharded optimizer, our FSDP and torch's FSDP, each
configuration in processes of its own (cs336_systems/bench/fsdp/memory.py), written to
writeup/results/<tag>/fsdp_memory.json: what fsdp_accounting (a) compares with the accounting
at the handout's xl size, which the step benchmark cannot hold four times on one GPU.

    # one GPU: two gloo ranks share it; each has its own allocator, so memory is per rank
    python scripts/bench_fsdp_memory.py --device cuda --backend gloo --world-size 2 --model-size xl \
        --context-length 128 --global-batch 8 --configurations ddp zero1 fsdp
"""

from __future__ import annotations

import sys

from cs336_systems import cli
from cs336_systems.bench.fsdp.memory import FsdpMemoryRecord, FsdpMemorySetting, run_fsdp_memory
from cs336_systems.bench.script import workload_line, write_and_report


def build_parser() -> cli.Parser:
    """The flags, generated from FsdpMemorySetting, plus --out and --tag."""
    return cli.Parser(FsdpMemorySetting, __doc__, results_kind=FsdpMemoryRecord.KIND)


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, out = build_parser().parse_with_output(argv)
    run = run_fsdp_memory(setting)
    rows = [[r.configuration, *(cli.in_mb(max(v)) for v in (r.built_bytes, r.peak_bytes, r.held_after_step_bytes))]
            for r in run.records]
    report = (f"{workload_line(setting, run.n_parameters, run.world_size)}; MB above the level before building, "
              f"largest rank\n{cli.format_table(['config', 'built', 'peak', 'held after step'], rows)}")
    return write_and_report(out, FsdpMemoryRecord.KIND, setting, run, report)


if __name__ == "__main__":
    sys.exit(main())
