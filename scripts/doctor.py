"""Diagnose a DDP set-up: check-in, step times, sampler shards, parameter agreement, all-reduce cost.

Prints a per-rank table and, for each problem found, a plain-language finding with its usual
cause; exits 1 if anything was found, 0 with an OK summary otherwise (2: bad arguments).
See cs336_systems/doctor.py for what is checked and how.

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

import argparse
import os
import sys

from cs336_systems.doctor import (
    INJECTIONS,
    DoctorOptions,
    exit_status,
    format_report,
    run_doctor,
    validate_options,
    write_report,
)
from cs336_systems.launch import running_under_launcher


def parse_args(argv: list[str] | None) -> DoctorOptions | argparse.Namespace:
    d = DoctorOptions()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=d.world_size, help="ranks to spawn (not under torchrun)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=d.device_type)
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl on cuda, gloo on cpu")
    p.add_argument("--model-size", default=d.model_size, help="model of the step and of the bucket suggestion")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank per step")
    p.add_argument("--dataset-len", type=int, default=d.dataset_len, help="samples the sampler shards")
    p.add_argument("--steps", type=int, default=d.timed_steps, help="timed training steps")
    p.add_argument("--straggler-factor", type=float, default=d.straggler_factor)
    p.add_argument("--checkin-timeout-s", type=float, default=d.checkin_timeout_s)
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="process-group timeout")
    p.add_argument("--inject", choices=INJECTIONS, default=None, help="plant a known fault")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = DoctorOptions(
        world_size=args.world_size,
        device_type=args.device,
        backend=args.backend,
        model_size=args.model_size,
        batch_size=args.batch_size,
        dataset_len=args.dataset_len,
        timed_steps=args.steps,
        straggler_factor=args.straggler_factor,
        checkin_timeout_s=args.checkin_timeout_s,
        timeout_s=args.timeout_s,
        inject=args.inject,
    )
    try:
        validate_options(options)
        report = run_doctor(options)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Every rank built the same report; under torchrun, rank 0 speaks for all, its exit status
    # included: a rank exiting 1 makes torchrun kill the others, perhaps while rank 0 writes.
    if running_under_launcher() and os.environ["RANK"] != "0":
        return 0
    print(format_report(report))
    if args.json:
        write_report(args.json, report)
    return exit_status(report)


if __name__ == "__main__":
    sys.exit(main())
