"""Beyond the handout: the bucketed-DDP lever ablation (``ddp_step-ablation.json``), timed beside torch's DDP.

The ablation is a run of the DDP step benchmark (``scripts/bench_ddp.py --ablation``) with
:data:`~cs336_systems.bench.step.variants.ABLATION_VARIANTS`; its records are StepRecords.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import math

import numpy as np
import torch
from matplotlib.figure import Figure

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import COMPUTE_ONLY, TORCH_DDP, communication_dtype
from cs336_systems.units import MB
from cs336_systems.writeup import fmt
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import not_measured_notes
from cs336_systems.writeup.ddp_analysis import STEP_KIND, ablation_runs, by_variant
from cs336_systems.writeup.figures import error_bars, save
from cs336_systems.writeup.bucket_plan import first_bucket_lever_text, parameter_shapes
from cs336_systems.writeup.paired import difference_clause, listed, paired, signed_ms
from cs336_systems.writeup.step_setting import setting_paragraph
from cs336_systems.writeup.step_tables import ddp_setting_line

DEFAULT_BUCKETED = "bucketed-25MB"
AUTO_BUCKETED = "bucketed-auto"
BF16_BUCKETED = "bucketed-25MB-bf16"
NO_FIRST_BUCKETED = "bucketed-25MB-no-first"

# What each ablation variant is, in one line (the levers: cs336_systems/ddp/bucketed.py).
VARIANT_MEANING = {
    COMPUTE_ONLY: "no communication: the floor every overhead is measured from",
    "per-parameter": "one asynchronous all-reduce per parameter, started from its gradient hook",
    "bucketed-25MB-plain": "25 MB buckets, every lever off",
    "bucketed-25MB-copy": "25 MB buckets, gradient views off",
    NO_FIRST_BUCKETED: "25 MB buckets, first-bucket cap off",
    "bucketed-25MB-no-reorder": "25 MB buckets, rebuild in ready order off",
    DEFAULT_BUCKETED: "25 MB buckets, every lever on (the default)",
    BF16_BUCKETED: "the default, communicating in bfloat16",
    AUTO_BUCKETED: "the default, bucket size chosen in its first steps by timing 25 MB and the overhead model's sizes",
    TORCH_DDP: "PyTorch's `DistributedDataParallel` at its defaults",
}
# (lever, the variant with that lever alone switched off) for the lever-by-lever comparison.
LEVER_OFF = (
    ("gradient views", "bucketed-25MB-copy"),
    ("first-bucket cap", NO_FIRST_BUCKETED),
    ("rebuild in ready order", "bucketed-25MB-no-reorder"),
    ("all three levers", "bucketed-25MB-plain"),
)

LEVERS_TEXT = """Our `BucketedDDP` has levers beyond the handout, each on by default, and the ablation times it with each one off:

- **gradient views** (`gradient_as_bucket_view`): each parameter's `.grad` is a view into its bucket's buffer, so gradients are neither copied into the bucket before its all-reduce nor copied back after it.
- **first-bucket cap** (`first_bucket_mb`, on by default, as in torch's DDP): the first bucket to fill closes once it reaches this cap (torch's rule, as for every bucket), so that the first all-reduce can start early in backward. A parameter larger than the cap fills that bucket alone; what the lever changes for this model is read from the buckets actually built, below.
- **rebuild in ready order** (`reorder_after_first_step`): after the first step the buckets are rebuilt in the order the gradients actually became ready, so each bucket fills in one stretch of backward.
- **bf16 communication** (`comm_dtype=torch.bfloat16`, off by default): gradients are all-reduced in bfloat16, half the bytes. bfloat16 keeps far fewer significant bits than float32, so it changes the averaged gradients measurably: the run reduces one step's gradients both ways and reports the error below; `tests/test_ddp_equivalence.py` checks this variant against float32 bucketing within bfloat16's rounding rather than exactly.
- **automatic bucket size** (`bucket_size_mb="auto"`): in its first steps the wrapper times 25 MB beside the overhead model's size (section above, with $o$ and $w$ fitted to all-reduces it times at start-up) and its half and double, and keeps 25 MB unless another size was faster in every round (`cs336_systems/ddp/auto_bucket.py`); its tuning steps are part of the warm-up here, not timed.

Every variant ran once per round, all in the same interleaved run, so step $i$ of each variant and of the compute-only step ran seconds apart under the same machine load. Each exposed overhead is the median over rounds of (the variant's step − the compute-only step of the same round), and each comparison of two variants is the median of their per-round differences with its 95% interval (distribution-free, from the sign test; `cs336_systems/bench/stats.py`): a difference whose interval contains zero is *indistinguishable here*."""


def _cap_mb(r: StepRecord) -> str:
    """The bucket cap a bucketed variant used: the one "auto" chose, or the one it was given."""
    if r.bucket_cap_bytes:
        return fmt.size_mb(r.bucket_cap_bytes / MB)
    if r.bucket_size_mb is not None:
        return fmt.size_mb(r.bucket_size_mb)
    return "–"


def _ablation_table(records: list[StepRecord], torch_ddp: StepRecord | None) -> str:
    rows = []
    for r in records:
        against = paired(r, torch_ddp) if torch_ddp is not None and r.variant not in (COMPUTE_ONLY, TORCH_DDP) else None
        rows.append([r.variant, VARIANT_MEANING.get(r.variant, "–"), "–" if r.n_buckets is None else r.n_buckets,
                     _cap_mb(r) if r.is_bucketed else "–", fmt.ms(r.median_step_s),
                     f"{fmt.ms(r.min_step_s)}–{fmt.ms(r.max_step_s)}", fmt.ms(r.exposed_overhead_s),
                     "–" if r.variant == COMPUTE_ONLY else fmt.ms_interval(r.exposed_overhead_ci95_s),
                     "–" if against is None else signed_ms(against.median_s),
                     "–" if against is None else fmt.ms_interval(against.interval_s)])
    return fmt.table(["variant", "what it is", "buckets", "bucket cap (MB)", "median step (ms)", "min–max (ms)",
                      "exposed overhead (ms)", "its 95% interval (ms)", "step − torch DDP's, per round (ms)",
                      "its 95% interval (ms)"], rows, align="llrrrrrrrr")


def _bf16_sentence(default: StepRecord, bf16: StepRecord) -> str:
    dtype = communication_dtype(bf16.variant)
    text = f"bfloat16 communication moves half the bytes: {difference_clause(paired(bf16, default))}."
    if dtype is not None:
        eps = torch.finfo(dtype).eps  # the gap from 1 to the next number: 2**-(significant bits - 1)
        bits, rounding = round(-math.log2(eps)) + 1, eps / 2
        text += (f" It keeps {bits} significant bits, so each rounding to it is off by up to {fmt.pct(rounding)} of "
                 "the value")
        if bf16.comm_error_rel is not None:
            text += (f"; reducing one step's gradients of this run both ways, the bfloat16 average differs from the "
                     f"float32 one by {fmt.pct(bf16.comm_error_rel)} (relative L2 error)")
        text += ". That changes training numerically, so it is an option, not the default."
    return text


def _ablation_discussion(records: list[StepRecord], shapes: dict) -> str:
    v = by_variant(records)
    floor, torch_ddp = v.get(COMPUTE_ONLY), v.get(TORCH_DDP)
    if floor is None:
        return "This run has no compute-only record, so no overhead can be judged."
    out = [f"Noise: the compute-only step alone ranges over {fmt.ms(floor.max_step_s - floor.min_step_s)} ms "
           f"(max − min of its {floor.steps_timed} timed steps), mostly load that drifts from round to round "
           "and hits every variant of a round alike; the per-round differences below cancel that part."]
    if torch_ddp is None:
        out.append("This run has no torch DDP record, so nothing is compared with it.")
    else:
        against = [paired(r, torch_ddp) for r in records if r.variant not in (COMPUTE_ONLY, TORCH_DDP)]
        shorter = [d.a for d in against if d.resolved and d.median_s < 0]
        longer = [d.a for d in against if d.resolved and d.median_s > 0]
        same = [d.a for d in against if d.interval_s is not None and not d.resolved]
        unknown = [d.a for d in against if d.interval_s is None]
        parts = [f"shorter: {listed(shorter)}" if shorter else "no variant's step is resolved shorter",
                 f"longer: {listed(longer)}" if longer else "none resolved longer"]
        if same:
            parts.append(f"indistinguishable here: {listed(same)}")
        if unknown:
            parts.append(f"no 95% interval from {against[0].rounds} rounds: {listed(unknown)}")
        out.append("Against torch DDP, round by round (table above): " + "; ".join(parts) + ".")
    default = v.get(DEFAULT_BUCKETED)
    no_first = v.get(NO_FIRST_BUCKETED)
    if default is not None and no_first is not None and shapes:
        plan = first_bucket_lever_text(default, no_first, shapes)
        if plan:
            out.append(plan)
    levers = [(lever, v[name]) for lever, name in LEVER_OFF if name in v]
    if default is not None and levers:
        parts = [f"{lever} off: {difference_clause(paired(off, default))}" for lever, off in levers]
        out.append(f"Each lever switched off, against {DEFAULT_BUCKETED} (a longer step with the lever off means "
                   "the lever helps): " + "; ".join(parts) + ".")
    bf16 = v.get(BF16_BUCKETED)
    if default is not None and bf16 is not None:
        out.append(_bf16_sentence(default, bf16))
    return "\n".join(f"- {line}" for line in out)


def _interval_ms(r: StepRecord) -> tuple[float, float] | None:
    interval = r.exposed_overhead_ci95_s
    return (interval[0] * 1e3, interval[1] * 1e3) if interval else None


def exposed_overhead_figure(records: Sequence[StepRecord], title: str, path: Path) -> Path:
    """Exposed overhead per variant (bars with 95% intervals), torch DDP's as a reference line and band."""
    shown = [r for r in records if r.variant not in (COMPUTE_ONLY, TORCH_DDP)]
    torch_ddp = next((r for r in records if r.variant == TORCH_DDP), None)
    height = 0.42 * len(shown) + 1.9
    fig = Figure(figsize=(8.0, height))
    fig.subplots_adjust(left=0.26, right=0.97, bottom=1.0 / height, top=1 - 0.35 / height)
    ax = fig.subplots()
    y = np.arange(len(shown))[::-1]
    values = np.array([r.exposed_overhead_s for r in shown]) * 1e3
    intervals = [_interval_ms(r) for r in shown]
    errors = (error_bars(values, np.array([lo for lo, _ in intervals]), np.array([hi for _, hi in intervals]))
              if all(intervals) else None)
    ax.barh(y, values, xerr=errors, capsize=3, color="tab:blue", alpha=0.7,
            label="exposed overhead (median over rounds of step − compute-only step; bars: 95% interval)")
    if torch_ddp is not None:
        t = torch_ddp.exposed_overhead_s * 1e3
        ax.axvline(t, color="tab:red", ls="--", label=f"torch DDP ({fmt.ms(torch_ddp.exposed_overhead_s)} ms)")
        torch_interval = _interval_ms(torch_ddp)
        if torch_interval:
            ax.axvspan(*torch_interval, color="tab:red", alpha=0.12, label="torch DDP's 95% interval")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(y, [r.variant for r in shown])
    ax.set(xlabel="exposed overhead per step (ms)", title=title)
    ax.grid(True, axis="x", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="lower center", ncols=2)
    return save(fig, path)


def ablation_section(ctx: RenderContext) -> Section:
    out = ["## Beyond: bucketed DDP against torch's DDP (lever ablation)", "", LEVERS_TEXT]
    figures = []
    runs = ablation_runs(ctx.inputs)
    for machine, results in runs:
        records = results.records
        torch_ddp = by_variant(records).get(TORCH_DDP)
        path = exposed_overhead_figure(records, f"exposed overhead per variant on {machine.tag}",
                                       ctx.figure_path(f"{machine.tag}_{results.name}_exposed_overhead.png"))
        figures.append(path)
        out += ["", fmt.run_heading(machine, results), "", ddp_setting_line(results), "",
                setting_paragraph(results.setting, results.environment, results.notes), "",
                _ablation_table(records, torch_ddp), "",
                ctx.image(path, f"exposed overhead per variant on {machine.tag}"), "",
                _ablation_discussion(records, parameter_shapes(results.setting))]
    notes = not_measured_notes(ctx.inputs, STEP_KIND, "Lever ablation (`scripts/bench_ddp.py --ablation`)",
                               runs=[f for _, f in runs])
    if notes:
        out += ["", "### Not measured here", "", notes]
    return Section("\n".join(out), figures)
