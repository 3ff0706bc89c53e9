"""Diagnose a DDP set-up: check-in, step times, sampler shards, parameter agreement, all-reduce cost.

Prints a per-rank table and, for each problem found, a plain-language finding with its usual
cause; exits 1 if anything was found, 0 with an OK summary otherwise (2: bad arguments).
--out also writes the report as a results file (kind "doctor"). See cs336_systems/doctor/ for
what is checked and how.

    # plain command: spawns 2 ranks on this machine (gloo on CPU)
    python scripts/doctor.py

    # GPUs of this machine, NCCL; the suggested bucket for a bigger model
    python scripts/doctor.py --device cuda --world-size 4 --model-size small

    # under torchrun: one process per rank, as a real job starts
    torchrun --nproc-per-node 2 scripts/doctor.py --device cuda

    # on a SLURM cluster through submitit
    python scripts/submit_slurm.py --nodes 1 --gpus-per-node 2 -- scripts/doctor.py --device cuda

    # see what a finding looks like: plant a known fault
    python scripts/doctor.py --inject overlapping-shards
    python scripts/doctor.py --inject missing-rank --checkin-timeout-s 3
"""

from __future__ import annotations

import sys

from cs336_systems import cli
from cs336_systems.doctor import DoctorReport, DoctorSetting, exit_status, format_report, run_doctor
from cs336_systems.results.environment import collect_environment
from cs336_systems.results.files import save_results


def build_parser() -> cli.Parser:
    """The flags, generated from DoctorSetting, plus --out (no default: written only when asked)."""
    parser = cli.Parser(DoctorSetting, __doc__)
    parser.add_argument("--out", type=cli.OutputFile(), default=None, metavar="PATH",
                        help="also write the report as a results file (kind \"doctor\")")
    return parser


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, args = build_parser().parse_settings(argv)
    run = run_doctor(setting)
    # Every rank built the same report; under torchrun, rank 0 speaks for all, its exit status
    # included: a rank exiting 1 makes torchrun kill the others, perhaps while rank 0 writes.
    if run.rank != 0:
        return 0
    [report] = run.reports
    print(format_report(report))
    if args.out:
        first = report.ranks[0]
        environment = collect_environment(first.backend, first.world_size, setting.device, run.shared_gpu)
        save_results(args.out, DoctorReport.KIND, setting, [report], environment)
    return exit_status(report)


if __name__ == "__main__":
    sys.exit(main())
