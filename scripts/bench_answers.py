"""The answers beside the library and torch: step time of each technique, in one run.

Trains the Transformer LM with each handout technique three ways (the answer in
cs336_systems/answers/, the library's wrapper, torch's own), each on its own model copy,
interleaved round by round, and writes one record per (technique, implementation) to
writeup/results/<tag>/answers_step.json: the median step (slowest rank) with its 95% interval,
and the paired difference from the library's step. See cs336_systems/bench/answers. Step times
need a quiet machine: a shared one's load moves them more than the differences measured.

    # plain command: spawns the ranks on this machine (gloo on CPU by default)
    python scripts/bench_answers.py --model-size cpu-small --world-size 2 --rounds 8

    # under torchrun: one process per rank, rendezvous from the environment
    torchrun --nproc-per-node 2 scripts/bench_answers.py --device cuda --model-size xl --context-length 128
"""

from __future__ import annotations

import sys

from cs336_systems import cli
from cs336_systems.bench.answers import AnswersSetting, AnswersStepRecord, run_answers_benchmark
from cs336_systems.bench.script import write_and_report


def build_parser() -> cli.Parser:
    """The flags, generated from AnswersSetting, plus --out and --tag."""
    return cli.Parser(AnswersSetting, __doc__, results_kind=AnswersStepRecord.KIND)


def format_records(records: list[AnswersStepRecord]) -> str:
    rows = []
    for r in records:
        vs = None if r.vs_library_s is None else cli.in_ms(r.vs_library_s) + (
            f" [{cli.in_ms(r.vs_library_ci95_s[0])}, {cli.in_ms(r.vs_library_ci95_s[1])}]" if r.vs_library_ci95_s else "")
        rows.append([r.technique, r.implementation, cli.in_ms(r.median_step_s), vs])
    return cli.format_table(["technique", "implementation", "step ms", "vs library ms [95%]"], rows)


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, out = build_parser().parse_with_output(argv)
    run = run_answers_benchmark(setting)
    return write_and_report(out, AnswersStepRecord.KIND, setting, run, format_records(run.records))


if __name__ == "__main__":
    sys.exit(main())
