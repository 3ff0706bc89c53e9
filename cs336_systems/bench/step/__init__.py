"""The DDP step benchmark (problems 3, 4, 5a and 6a, and the lever ablation): every variant's
training step, timed side by side in interleaved rounds.

* setting.py    StepSetting: the workload, the variants, the rounds (the script's flags)
* variants.py   the variant names (compute-only, ours from ``ddp.VARIANTS``, bucketed-<N>MB[-lever], torch-ddp)
* run.py        the interleaved rounds on every rank, slowest rank per step
* probes.py     beside the steps: flat's copies timed, a narrower comm dtype's error measured
* record.py     StepRecord, one per variant in ``ddp_step.json``, built by the rank that measured it:
                medians, the exposed overhead paired round by round, tokens/s
"""

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.run import StepRun, run_step_benchmark
from cs336_systems.bench.step.setting import StepSetting
from cs336_systems.bench.step.variants import (
    ABLATION_VARIANTS,
    COMPUTE_ONLY,
    FLAT,
    LEVER_SUFFIXES,
    PLAIN_VARIANTS,
    TORCH_DDP,
    VariantName,
    bucket_size_of,
    bucketed_name,
    check_variant_name,
    communication_dtype,
    parse_bucketed,
)
