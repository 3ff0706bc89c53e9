"""``python -m grading``: grade a submission or a folder of them (``make grade``).

    python -m grading SUBMISSION [--out DIR] [--repeats N] [--edition 2025|2026] [--only PROBLEM]
    python -m grading --folder FOLDER [--out DIR] [--jobs N] [--executor inprocess|local|slurm]
                      [--partition P] [--regrade] [--make-private]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from grading.course.course import EXECUTORS, grade_folder, safe_name
from grading.harness import Limits, grade
from grading.problems import GRADED
from grading.selfcheck import GraderFailure, SetupError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grading", description=__doc__.splitlines()[0])
    parser.add_argument("submission", nargs="?", type=Path, help="a checkout (folder) or a zip")
    parser.add_argument("--folder", type=Path, help="grade every checkout and zip in this folder")
    parser.add_argument("--out", type=Path, help="default: grades/<submission name>/ (grades/ for a folder)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each test; it scores only if all pass")
    parser.add_argument("--edition", choices=("2025", "2026"), help="default: from the adapters it implements")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="submissions graded at once")
    parser.add_argument("--test-timeout", type=float, default=Limits.test_timeout_s, help="seconds per test")
    parser.add_argument("--time-limit", type=float, default=Limits.submission_timeout_s,
                        help="seconds for a whole submission")
    parser.add_argument("--memory-gb", type=float, default=Limits.memory_gb, help="address space per process")
    parser.add_argument("--only", action="append", choices=GRADED["both"], metavar="PROBLEM",
                        help="grade only this problem (repeat for more): a regrade")
    parser.add_argument("--executor", choices=EXECUTORS, default="inprocess",
                        help="a folder: graded here, or one job each through submitit (local or slurm)")
    parser.add_argument("--partition", help="the SLURM partition (--executor slurm)")
    parser.add_argument("--regrade", action="store_true", help="a folder: grade again what was graded before")
    parser.add_argument("--make-private", action="store_true",
                        help="a folder (as root, no namespaces): make it 0700 instead of refusing one others can read")
    args = parser.parse_args(argv)
    if (args.submission is None) == (args.folder is None):
        parser.error("give one SUBMISSION or --folder FOLDER")
    if args.repeats < 1 or args.jobs < 1 or args.test_timeout <= 0 or args.time_limit <= 0:
        parser.error("--repeats, --jobs, --test-timeout and --time-limit must be positive")
    if args.executor == "slurm" and not args.partition:
        parser.error("--executor slurm needs --partition")
    if args.submission is not None and (args.executor != "inprocess" or args.regrade or args.make_private):
        parser.error("--executor, --regrade and --make-private are for a --folder")
    only = tuple(args.only) if args.only else None
    target = args.folder or args.submission
    if not target.exists():
        parser.error(f"{target} does not exist")
    if args.submission is not None and not (target.is_dir() or target.suffix == ".zip"):
        parser.error(f"{target} is neither a folder nor a .zip")
    limits = Limits(args.test_timeout, args.time_limit, args.memory_gb)
    # SIGTERM (a job's time limit, a TA's kill) unwinds as SystemExit: the run is stopped and its
    # scratch copy and cgroup removed, as after an error (SIGKILL leaves them to the next grading)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        _grade(args, limits, only)
    except (SetupError, GraderFailure) as e:  # nothing was written: say why in one line
        print(f"python -m grading: {e}", file=sys.stderr)
        return 3
    return 0


def _grade(args: argparse.Namespace, limits: Limits, only: tuple[str, ...] | None) -> None:
    if args.folder:
        grade_folder(args.folder, args.out or Path("grades"), args.repeats, args.edition, limits, args.jobs, only,
                     executor=args.executor, partition=args.partition, regrade=args.regrade,
                     make_private=args.make_private)
    else:
        name = args.submission.resolve().name.removesuffix(".zip")
        grade(args.submission, args.out or Path("grades") / safe_name(name), args.repeats, args.edition, limits,
              only=only)


if __name__ == "__main__":
    sys.exit(main())
