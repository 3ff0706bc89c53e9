"""The tuning guides' DDP claims, measured through PyTorch Lightning: each knob on and off on
torch's DDP (Lightning's DDPStrategy) and on ours (CS336DDPStrategy), interleaved round by round,
step time and peak memory, and BatchNorm statistics with sync_batchnorm off and on; written to
writeup/results/<tag>/lightning_claims.json (the writeup's "What the tuning guides claim, measured").

Three ways to run it:

    # plain command: spawns the ranks on this machine (gloo on CPU by default)
    python scripts/bench_lightning.py --model-size cpu-small --world-size 2

    # one GPU: two ranks share it over gloo (every record says so)
    python scripts/bench_lightning.py --device cuda --backend gloo --world-size 2 --model-size small

    # two GPUs or more: NCCL, one process per rank
    torchrun --nproc-per-node 2 scripts/bench_lightning.py --device cuda --model-size small
"""

from __future__ import annotations

import sys

from cs336_systems import cli
from cs336_systems.bench.claims import ClaimsRecord, ClaimsSetting, run_claims_benchmark
from cs336_systems.bench.claims.verdicts import judge_all
from cs336_systems.bench.script import workload_line, write_and_report


def build_parser() -> cli.Parser:
    """The flags, generated from ClaimsSetting, plus --out and --tag."""
    return cli.Parser(ClaimsSetting, __doc__, results_kind=ClaimsRecord.KIND)


def format_verdicts(records: list[ClaimsRecord], fit_per_process: bool = False) -> str:
    rows = [[v.claim.knob, v.claim.change, v.claim.claimed, v.speedup_text, v.memory_text, v.verdict,
             v.memory_verdict or "-"] for v in judge_all(records, memory_evidence=fit_per_process)]
    return cli.format_table(["knob", "change", "claimed", "measured speed-up", "memory", "verdict",
                                   "memory verdict"], rows)


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, out = build_parser().parse_with_output(argv)
    run = run_claims_benchmark(setting)
    report = (f"{workload_line(setting, run.n_parameters, run.world_size)}; speed-up = baseline / tuned step "
              f"time, median over rounds, 95% interval\n{format_verdicts(run.records, run.fit_per_process)}\n"
              f"BatchNorm running statistics against one process on the whole batch: {run.batchnorm}")
    return write_and_report(out, ClaimsRecord.KIND, setting, run, report)


if __name__ == "__main__":
    sys.exit(main())
