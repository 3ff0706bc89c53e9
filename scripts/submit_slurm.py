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

from cs336_systems.launch.slurm import SlurmJobSpec, log_paths, submit_script, wait_for_exit_codes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = SlurmJobSpec()
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage="%(prog)s [options] -- SCRIPT [SCRIPT ARGS ...]",
    )
    p.add_argument("--nodes", type=int, default=d.nodes)
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    p.add_argument("--tasks-per-node", type=int, default=None, help="default: --gpus-per-node, or 1")
    p.add_argument("--cpus-per-task", type=int, default=None)
    p.add_argument("--partition", default=None)
    p.add_argument("--time-min", type=int, default=d.time_min)
    p.add_argument("--folder", default=d.folder, help="submitit logs (default: %(default)s)")
    p.add_argument("--cluster", choices=["local", "debug"], default=None,
                   help="run without SLURM: 'local' subprocesses or 'debug' in this process")
    p.add_argument("--name", default=d.name, help="job name")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS ...]")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the script to run after --, e.g. -- scripts/bench_ddp.py --device cuda")
    args.script, args.script_args = command[0], command[1:]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = SlurmJobSpec(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        cpus_per_task=args.cpus_per_task,
        partition=args.partition,
        time_min=args.time_min,
        folder=args.folder,
        cluster=args.cluster,
        name=args.name,
    )
    try:
        job = submit_script(spec, args.script, args.script_args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"submitted job {job.job_id}: {spec.world_size} ranks ({spec.nodes} node(s) x "
          f"{spec.ranks_per_node}) running {args.script}; waiting ...", flush=True)
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
