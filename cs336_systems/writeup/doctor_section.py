"""Beyond the handout: what ``make doctor`` checks (static text: a diagnosis, not a measurement to show)."""

from __future__ import annotations

from cs336_systems.writeup.context import RenderContext, Section

DOCTOR_TEXT = """## Beyond: make doctor

`make doctor` runs one short diagnostic job (`scripts/doctor.py`: 2 ranks with gloo on this machine by default; its docstring shows the torchrun and SLURM forms, and `--device cuda` for GPUs) and checks a data-parallel set-up rank by rank (`cs336_systems/doctor/`: the ranks in `run.py`, the pure finders in `findings.py`, the report in `report.py`):

- **check-in**: every rank writes a key to the rendezvous store; rank 0 names the ranks missing after `--checkin-timeout-s` (a store key, unlike a collective, says *which* rank is absent).
- **stragglers**: each rank times the compute of `--steps` training steps, before waiting for gradients, since in DDP every rank's step includes waiting for the slowest; a rank whose fastest step is `--straggler-factor` times the others' median is named.
- **data shards**: every rank's `DistributedSampler` indices are gathered and checked for overlaps and for samples no rank gets.
- **replica agreement**: checksums of every parameter are compared across ranks before any broadcast, after wrapping in DDP, and after the training steps.
- **all-reduce cost**: the same calibration `bucket_size_mb="auto"` runs (`cs336_systems/ddp/auto_bucket.py`: every sum checked, slowest rank per iteration, one fallback rule when the fit is not physical) fits time = $o$ + bytes / $w$, and the doctor suggests the bucket size $\\sqrt{s\\,w\\,o}$ for the model's $s$ gradient bytes.

It prints a per-rank table and, for each problem, a plain-language finding with the values seen and the usual cause; it exits 1 when it finds anything, 0 with an OK summary otherwise (2 for bad arguments, before any rank starts). `--out PATH` also writes the report as a results file of kind `doctor` (`DoctorReport`); a diagnosis of one job is not a measurement of this page, so none is shown here. To see what each finding looks like, plant a known fault:

- `make doctor DOCTOR_ARGS="--inject overlapping-shards"`: every rank builds its sampler as if it were rank 0;
- `make doctor DOCTOR_ARGS="--inject unseeded-no-broadcast"`: each rank seeds differently and the model trains unwrapped;
- `make doctor DOCTOR_ARGS="--inject straggler"`: rank 1 sleeps in every step;
- `make doctor DOCTOR_ARGS="--inject missing-rank --checkin-timeout-s 3"`: rank 1 checks in only after rank 0 has given up on it."""


def doctor_section(ctx: RenderContext) -> Section:
    return Section(DOCTOR_TEXT)
