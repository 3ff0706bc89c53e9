"""What the profiler runs: the workload, which variants, how many warm-up and profiled steps."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from cs336_systems import cli
from cs336_systems.bench.workload import WorkloadSetting

# Naive DDP communicates after backward, per-parameter DDP during it: the pair problem 5b asks
# to compare (both names are keys of cs336_systems.ddp.VARIANTS).
PROFILED_VARIANTS = ("naive", "per-parameter")


@dataclass(frozen=True)
class ProfileSetting(WorkloadSetting):
    """The workload and the profiled steps of each variant."""

    variants: tuple[str, ...] = field(default=PROFILED_VARIANTS, metadata=cli.choice(
        "variants to profile, one after another in one process group", PROFILED_VARIANTS, many=True))
    warmup_steps: int = field(default=2, metadata=cli.count(
        "unprofiled steps of each variant first (per-parameter DDP settles its order in step 1)", minimum=0))
    steps: int = field(default=2, metadata=cli.count("profiled steps of each variant; the timelines show the last"))

    def validate(self) -> None:
        """ValueError for a setting that cannot run, before any process starts."""
        super().validate()
        unknown = [v for v in self.variants if v not in PROFILED_VARIANTS]
        if unknown or not self.variants or len(set(self.variants)) != len(self.variants):
            raise ValueError(f"--variants must name each of {', '.join(PROFILED_VARIANTS)} at most once, "
                             f"got {' '.join(self.variants)}")


def nsys_command(setting: ProfileSetting, out: Path | None = None) -> str:
    """The Nsight Systems command that records the same run (model, batch, steps) on GPUs with
    NCCL, with CUDA and NVTX lanes; without ``out`` the script writes to its default path."""
    script_args = [
        "--device", "cuda", "--model-size", setting.model_size, "--context-length", str(setting.context_length),
        "--global-batch", str(setting.global_batch), "--seed", str(setting.seed),
        "--warmup-steps", str(setting.warmup_steps), "--steps", str(setting.steps),
    ]
    if out is not None:
        script_args += ["--out", str(out)]
    command = ["nsys", "profile", "-t", "cuda,nvtx,osrt", "-o", "ddp_profile", "torchrun",
               "--nproc-per-node", str(setting.world_size), "scripts/profile_ddp.py", *script_args]
    return shlex.join(command)
