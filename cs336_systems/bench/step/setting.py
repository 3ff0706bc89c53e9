"""What one run of the DDP step benchmark measures: the workload, the variants, the rounds."""

from __future__ import annotations

from dataclasses import dataclass, field

from cs336_systems import cli
from cs336_systems.bench.step.variants import (
    ABLATION_VARIANTS,
    COMPUTE_ONLY,
    PLAIN_VARIANTS,
    TORCH_DDP,
    VariantName,
    bucketed_name,
    check_variant_name,
)
from cs336_systems.bench.workload import WorkloadSetting

LEARNING_RATE = 1e-4  # every variant's AdamW steps with it; the writeup's setting line names it


@dataclass(frozen=True)
class StepSetting(WorkloadSetting):
    """The workload (ranks, device, model, batch) and how its variants are timed."""

    bucket_sizes_mb: tuple[float, ...] = field(default=(1.0, 10.0, 100.0, 1000.0), metadata=cli.positive(
        "bucket caps of the sweep in MB, one bucketed-<N>MB variant each", high=cli.MAX_MB, many=True))
    rounds: int = field(default=3, metadata=cli.count(
        "interleaved rounds: each times every variant, the order rotated by one variant per round"))
    steps_per_round: int = field(default=3, metadata=cli.count("timed steps of each variant per round"))
    warmup_steps: int = field(default=1, metadata=cli.count(
        "untimed steps of each variant before it is first timed", minimum=0))
    rebuild_each_round: bool = field(default=False, metadata=cli.switch(
        "build, warm up and drop our wrappers within each round, so that only one wrapper's gradient "
        "buffers exist at a time (large models)"))
    no_torch_ddp: bool = field(default=False, metadata=cli.switch("leave torch's DDP out of the sweep"))
    variants: tuple[str, ...] | None = field(default=None, metadata=cli.option(
        "explicit variants instead of the sweep, e.g. compute-only bucketed-25MB-copy torch-ddp", VariantName(),
        many=True))
    ablation: bool = field(default=False, metadata=cli.switch(
        "the bucketed-DDP lever ablation's variants instead of the sweep (written to ddp_step-ablation.json)"))

    def variant_names(self) -> list[str]:
        """The variants timed, in the order of the first round."""
        if self.ablation:
            return list(ABLATION_VARIANTS)
        if self.variants is not None:
            return list(self.variants)
        names = [COMPUTE_ONLY, *PLAIN_VARIANTS]
        names += [bucketed_name(mb) for mb in self.bucket_sizes_mb]
        if not self.no_torch_ddp:
            names.append(TORCH_DDP)
        return names

    def validate(self) -> None:
        """ValueError for a setting that cannot run, before any process starts."""
        super().validate()
        if self.ablation and self.variants is not None:
            raise ValueError("--ablation and --variants both choose the variants: give one of them")
        names = self.variant_names()
        for name in names:
            check_variant_name(name)
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"each variant may be timed once per run; repeated: {', '.join(repeated)}")
        if COMPUTE_ONLY not in names:
            raise ValueError(f"--variants must include {COMPUTE_ONLY!r}: exposed overhead is measured against it")

    @property
    def results_suffix(self) -> str | None:
        """The results file's suffix: the ablation is its own run of this kind."""
        return "ablation" if self.ablation else None
