"""Problem 5b: profiler timelines showing that per-parameter DDP overlaps all-reduce with backward.

Profiles a few training steps of naive and per-parameter DDP in one process group and writes,
into --out-dir (default writeup/results/<machine tag>/profile/):

* trace_naive.json, trace_per-parameter.json: rank 0's Chrome traces (.json.gz when large;
  open them in https://ui.perfetto.dev or chrome://tracing);
* timeline_naive.png, timeline_per-parameter.png: backward compute and all-reduce lanes of the
  last profiled step; timeline_overlap.png: both, naive above per-parameter, on one time axis;
* profile.json: per variant the overlap fraction (share of all-reduce time inside backward),
  all-reduce and backward time, and the number of all-reduce events, with the environment.

Three ways to run it:

    # plain command: spawns the ranks on this machine (gloo on CPU by default)
    python scripts/profile_ddp.py --model-size cpu-small --world-size 2

    # under torchrun: one process per rank (NCCL kernels appear on the GPU lanes)
    torchrun --nproc-per-node 2 scripts/profile_ddp.py --device cuda --model-size xl

    # on a SLURM cluster through submitit
    python scripts/submit_slurm.py --gpus-per-node 2 -- scripts/profile_ddp.py --device cuda --model-size xl
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from cs336_systems.ddp_profile import ProfileSetting, profile_ranks, render_timelines
from cs336_systems.launch import running_under_launcher
from cs336_systems.run_metadata import collect_environment, results_dir, write_results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = ProfileSetting()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-size", default=d.model_size)
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument("--global-batch", type=int, default=d.global_batch)
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--device", choices=["cpu", "cuda"], default=d.device_type)
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--steps", type=int, default=d.steps, help="profiled steps; the timelines show the last")
    p.add_argument("--out-dir", default=None, help="default: writeup/results/<machine tag>/profile")
    return p.parse_args(argv)


def nsys_command(args: argparse.Namespace, out_dir: Path) -> str:
    """The Nsight Systems command that records the same run with CUDA and NVTX lanes."""
    script_args = [
        "--device", "cuda", "--model-size", args.model_size, "--context-length", str(args.context_length),
        "--global-batch", str(args.global_batch), "--steps", str(args.steps), "--out-dir", str(out_dir),
    ]
    command = ["nsys", "profile", "-t", "cuda,nvtx,osrt", "-o", "ddp_profile", "torchrun",
               "--nproc-per-node", str(args.world_size), "scripts/profile_ddp.py", *script_args]
    return shlex.join(command)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir) if args.out_dir else results_dir() / "profile"
    setting = ProfileSetting(
        model_size=args.model_size,
        context_length=args.context_length,
        global_batch=args.global_batch,
        world_size=args.world_size,
        device_type=args.device,
        backend=args.backend,
        warmup_steps=args.warmup_steps,
        steps=args.steps,
        out_dir=str(out_dir),
    )
    try:
        profiles = profile_ranks(setting)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if profiles is None:
        return 0  # a rank other than 0 under torchrun/SLURM: rank 0 writes everything
    for p in profiles:
        render_timelines([(p.variant, p.timeline)], out_dir / f"timeline_{p.variant}.png")
    render_timelines([(p.variant, p.timeline) for p in profiles], out_dir / "timeline_overlap.png")
    world_size = int(os.environ["WORLD_SIZE"]) if running_under_launcher() else setting.world_size
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    meta = collect_environment(backend, world_size, setting.device_type)
    meta.update(
        benchmark="ddp_profile",
        setting={k: list(v) if isinstance(v, tuple) else v for k, v in asdict(setting).items() if k != "out_dir"},
        units={"time": "s", "overlap_fraction": "share of all-reduce time inside the backward range"},
    )
    write_results(out_dir / "profile.json", [p.record() for p in profiles], meta)
    print(f"{'variant':<15} {'overlap':>8} {'all-reduce ms':>14} {'backward ms':>12} {'events':>7}")
    for p in profiles:
        r = p.record()
        print(f"{p.variant:<15} {r['overlap_fraction']:>8.1%} {1e3 * r['communication_s']:>14.1f} "
              f"{1e3 * r['backward_s']:>12.1f} {r['n_comm_events']:>7}")
    print(f"wrote traces, timelines and profile.json to {out_dir}")
    print("with Nsight Systems on a GPU machine, record the same run with:")
    print(f"  {nsys_command(args, out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
