"""Beyond the handout: the bucketed-DDP lever ablation (``ddp_step-ablation.json``), timed beside torch's DDP.

The ablation is a run of the DDP step benchmark (``scripts/bench_ddp.py --ablation``) with
:data:`~cs336_systems.bench.step.variants.ABLATION_VARIANTS`; its records are StepRecords.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from cs336_systems.bench.stats import paired_median
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import COMPUTE_ONLY, TORCH_DDP
from cs336_systems.units import MB
from cs336_systems.writeup import fmt
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import not_measured_notes
from cs336_systems.writeup.ddp_analysis import STEP_KIND, ablation_runs, by_variant
from cs336_systems.writeup.figures import error_bars, save
from cs336_systems.writeup.step_tables import ddp_setting_line

DEFAULT_BUCKETED = "bucketed-25MB"
AUTO_BUCKETED = "bucketed-auto"
# The goals this repo set itself against torch's DDP, as (variant, largest exposed-overhead ratio).
GOALS = ((DEFAULT_BUCKETED, 0.9), ("per-parameter", 1.2))

# What each ablation variant is, in one line (the levers: cs336_systems/ddp/bucketed.py).
VARIANT_MEANING = {
    COMPUTE_ONLY: "no communication: the floor every overhead is measured from",
    "per-parameter": "one asynchronous all-reduce per parameter, started from its gradient hook",
    "bucketed-25MB-plain": "25 MB buckets, every lever off",
    "bucketed-25MB-copy": "25 MB buckets, gradient views off",
    "bucketed-25MB-no-first": "25 MB buckets, small first bucket off",
    "bucketed-25MB-no-reorder": "25 MB buckets, rebuild in ready order off",
    DEFAULT_BUCKETED: "25 MB buckets, every lever on (the default)",
    "bucketed-25MB-bf16": "the default, communicating in bfloat16",
    AUTO_BUCKETED: "the default, bucket size from the overhead model",
    TORCH_DDP: "PyTorch's `DistributedDataParallel` at its defaults",
}
# (lever, the variant with that lever alone switched off) for the lever-by-lever comparison.
LEVER_OFF = (
    ("gradient views", "bucketed-25MB-copy"),
    ("small first bucket", "bucketed-25MB-no-first"),
    ("rebuild in ready order", "bucketed-25MB-no-reorder"),
    ("all three levers", "bucketed-25MB-plain"),
)

LEVERS_TEXT = """Our `BucketedDDP` has levers beyond the handout, each on by default, and the ablation times it with each one off:

- **gradient views** (`gradient_as_bucket_view`): each parameter's `.grad` is a view into its bucket's buffer, so gradients are neither copied into the bucket before its all-reduce nor copied back after it.
- **small first bucket** (`first_bucket_mb`): the first bucket to fill is capped small (torch uses 1 MB), so the first all-reduce starts early in backward instead of after a full-size bucket.
- **rebuild in ready order** (`reorder_after_first_step`): after the first step the buckets are rebuilt in the order the gradients actually became ready, so each bucket fills in one stretch of backward.
- **bf16 communication** (`comm_dtype=torch.bfloat16`, off by default): gradients are all-reduced in bfloat16, half the bytes; this changes the numbers, so `tests/test_ddp_equivalence.py` checks it against float32 bucketing within bfloat16's rounding rather than exactly.
- **automatic bucket size** (`bucket_size_mb="auto"`): the size $\\sqrt{s\\,w\\,o}$ of the overhead model (section above), with $o$ and $w$ fitted to all-reduces this job times at start-up (`cs336_systems/ddp/auto_bucket.py`).

Every variant ran once per round, all in the same interleaved run, so step $i$ of each variant and of the compute-only step ran seconds apart under the same machine load. Each exposed overhead is the median over rounds of (the variant's step − the compute-only step of the same round), and each comparison of two variants is the median of their per-round differences, judged against its 95% interval (distribution-free, from the sign test; `cs336_systems/bench/stats.py`): a difference whose interval contains zero is called *within noise*."""


def _cap_mb(r: StepRecord) -> str:
    """The bucket cap a bucketed variant used: the one "auto" chose, or the one it was given."""
    if r.bucket_cap_bytes:
        return fmt.size_mb(r.bucket_cap_bytes / MB)
    if r.bucket_size_mb is not None:
        return fmt.size_mb(r.bucket_size_mb)
    return "–"


def _ratio_to(value_s: float, reference_s: float | None) -> str:
    return "–" if not reference_s or reference_s <= 0 else fmt.ratio(value_s / reference_s)


def _ablation_table(records: list[StepRecord], torch_exposed: float | None) -> str:
    rows = [[r.variant, VARIANT_MEANING.get(r.variant, "–"),
             "–" if r.n_buckets is None else r.n_buckets,
             _cap_mb(r) if r.is_bucketed else "–",
             fmt.ms(r.median_step_s), f"{fmt.ms(r.min_step_s)}–{fmt.ms(r.max_step_s)}",
             fmt.ms(r.exposed_overhead_s),
             "–" if r.variant == COMPUTE_ONLY else fmt.ms_interval(r.exposed_overhead_ci95_s),
             "–" if r.variant == COMPUTE_ONLY else _ratio_to(r.exposed_overhead_s, torch_exposed)]
            for r in records]
    return fmt.table(["variant", "what it is", "buckets", "bucket cap (MB)", "median step (ms)", "min–max (ms)",
                      "exposed overhead (ms)", "its 95% interval (ms)", "exposed overhead / torch DDP's"], rows,
                     align="llrrrrrrr")


def _paired_difference(a: StepRecord, b: StepRecord) -> tuple[float, str]:
    """(median over rounds of a's step − b's step, whether that stands out from the noise)."""
    difference, interval = paired_median(a.step_times_s, b.step_times_s)
    if interval is None:
        return difference, f"too few rounds ({len(a.step_times_s)}) for a 95% interval"
    lo, hi = interval
    word = "beyond the noise" if lo > 0 or hi < 0 else "within noise"
    return difference, f"{word}: 95% interval {fmt.ms(lo)} to {fmt.ms(hi)} ms"


def _signed_ms(seconds: float) -> str:
    return ("+" if seconds >= 0 else "") + fmt.ms(seconds)


def _goal_sentence(variant: StepRecord, limit: float, torch: StepRecord) -> str:
    exposed, reference = variant.exposed_overhead_s, torch.exposed_overhead_s
    ratio = exposed / reference
    verdict = "holds" if ratio <= limit else "does not hold"
    difference, noise = _paired_difference(variant, torch)
    return (f"{variant.variant}'s exposed overhead ≤ {limit:g}× torch DDP's: **{verdict}** in this run "
            f"({fmt.ratio(ratio)}: {fmt.ms(exposed)} against {fmt.ms(reference)} ms); its step minus torch DDP's, "
            f"round by round, is {_signed_ms(difference)} ms ({noise}).")


def _ablation_discussion(records: list[StepRecord]) -> str:
    v = by_variant(records)
    floor, torch = v.get(COMPUTE_ONLY), v.get(TORCH_DDP)
    if floor is None:
        return "This run has no compute-only record, so no overhead can be judged."
    out = [f"Noise: the compute-only step alone ranges over {fmt.ms(floor.max_step_s - floor.min_step_s)} ms "
           f"(max − min of its {floor.steps_timed} timed steps), mostly load that drifts from round to round "
           "and hits every variant of a round alike; the per-round differences below cancel that part."]
    bucketed = [r for r in records if r.is_bucketed]
    comparable = torch is not None and torch.exposed_overhead_s > 0
    if torch is None:
        out.append("This run has no torch DDP record: the goals, stated against it, cannot be judged.")
    elif not comparable:
        out.append(f"torch DDP's exposed overhead is not positive ({fmt.ms(torch.exposed_overhead_s)} ms): its "
                   "step was no slower than the compute-only step, so ratios to it are undefined and the goals "
                   "cannot be judged in this run.")
    else:
        for name, limit in GOALS:
            out.append(_goal_sentence(v[name], limit, torch) if name in v
                       else f"The goal for {name} (≤ {limit:g}× torch DDP's) cannot be judged: no record of it.")
    if bucketed:
        best = min(bucketed, key=lambda r: r.exposed_overhead_s)
        ratio = (f", {fmt.ratio(best.exposed_overhead_s / torch.exposed_overhead_s)} torch DDP's"
                 if comparable else "")
        out.append(f"Lowest exposed overhead of the bucketed variants: {best.variant}, "
                   f"{fmt.ms(best.exposed_overhead_s)} ms{ratio}.")
    default = v.get(DEFAULT_BUCKETED)
    levers = [(lever, v[name]) for lever, name in LEVER_OFF if name in v]
    if default is not None and levers:
        parts = []
        for lever, off in levers:
            difference, noise = _paired_difference(off, default)
            parts.append(f"{lever} off ({off.variant}): {_signed_ms(difference)} ms ({noise})")
        out.append(f"Step with one lever off minus {DEFAULT_BUCKETED}'s step, round by round (a positive "
                   "difference means the lever helps): " + "; ".join(parts) + ".")
    bf16 = v.get("bucketed-25MB-bf16")
    if default is not None and bf16 is not None:
        difference, noise = _paired_difference(bf16, default)
        word = "longer" if difference >= 0 else "shorter"
        out.append(f"bfloat16 communication moves half the bytes; its step is {fmt.ms(abs(difference))} ms {word} "
                   f"than float32's, round by round ({noise}), and its gradients differ from float32's in the last "
                   "bits, so it is an option, not the default.")
    return "\n".join(f"- {line}" for line in out)


def _interval_ms(r: StepRecord) -> tuple[float, float] | None:
    interval = r.exposed_overhead_ci95_s
    return (interval[0] * 1e3, interval[1] * 1e3) if interval else None


def exposed_overhead_figure(records: Sequence[StepRecord], title: str, path: Path) -> Path:
    """Exposed overhead per variant (bars with 95% intervals), torch DDP's as a reference line and band."""
    shown = [r for r in records if r.variant not in (COMPUTE_ONLY, TORCH_DDP)]
    torch = next((r for r in records if r.variant == TORCH_DDP), None)
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
    if torch is not None:
        t = torch.exposed_overhead_s * 1e3
        ax.axvline(t, color="tab:red", ls="--", label=f"torch DDP ({fmt.ms(torch.exposed_overhead_s)} ms)")
        torch_interval = _interval_ms(torch)
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
        v = by_variant(records)
        torch = v.get(TORCH_DDP)
        path = exposed_overhead_figure(records, f"exposed overhead per variant on {machine.tag}",
                                       ctx.figure_path(f"{machine.tag}_{results.name}_exposed_overhead.png"))
        figures.append(path)
        out += ["", fmt.run_heading(machine, results), "", ddp_setting_line(results), "",
                _ablation_table(records, torch.exposed_overhead_s if torch else None), "",
                ctx.image(path, f"exposed overhead per variant on {machine.tag}"), "", _ablation_discussion(records)]
    notes = not_measured_notes(ctx.inputs, STEP_KIND, "Lever ablation (`scripts/bench_ddp.py --ablation`)",
                               runs=[f for _, f in runs])
    if notes:
        out += ["", "### Not measured here", "", notes]
    return Section("\n".join(out), figures)


