"""Submit one of this repo's scripts to SLURM as a multi-rank job (via submitit), and wait for it.

Every task runs the script as one rank, with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set as torchrun would (see cs336_systems/launch/slurm.py). The
script's own arguments follow ``--``.

    # 2 nodes x 4 GPUs = 8 ranks, NCCL
    python scripts/submit_slurm.py --nodes 2 --gpus-per-node 4 --partition gpu --time-min 30 \\
        -- scripts/bench_ddp.py --device cuda --model-size xl

    # one node, 2 GPUs
    python scripts/submit_slurm.py --gpus-per-node 2 -- scripts/profile_ddp.py --device cuda

    # no cluster: 2 CPU tasks as local subprocesses (tests the same path)
    python scripts/submit_slurm.py --cluster local --tasks-per-node 2 -- scripts/bench_ddp.py

Exit status: the first non-zero status of any task, else 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cs336_systems import cli
from cs336_systems.launch.slurm import SlurmJobSpec, log_paths, submit_script, wait_for_exit_codes


def build_parser() -> cli.Parser:
    parser = cli.Parser(SlurmJobSpec, __doc__, usage="%(prog)s [options] -- SCRIPT [SCRIPT ARGS ...]")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS ...]")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    spec, args = parser.parse_settings(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the script to run after --, e.g. -- scripts/bench_ddp.py --device cuda")
    script, script_args = command[0], command[1:]
    if not Path(script).is_file():
        parser.error(f"script to run not found: {script}")
    job = submit_script(spec, script, script_args)
    print(f"submitted job {job.job_id}: {spec.world_size} ranks ({spec.nodes} node(s) x "
          f"{spec.ranks_per_node}) running {script}; waiting ...", flush=True)
    logs = log_paths(job)
    try:
        codes = wait_for_exit_codes(job)
    finally:
        print("logs (stdout; stderr ends in .err):")
        for path in logs:
            print(f"  {path}")
    failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
    if failed:
        print(f"ranks that exited non-zero (rank, status): {failed}", file=sys.stderr)
        return failed[0][1]
    print(f"all {len(codes)} ranks exited 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
