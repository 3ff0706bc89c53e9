"""Beyond the handout: the bucketed-DDP lever ablation, optimizer state sharding accounted for, the doctor.

The ablation and the accounting sections read ``ablation*.json`` (``scripts/bench_ddp.py
--ablation``) and ``sharded_optimizer*.json`` (``scripts/bench_sharded_optimizer.py``); every
number and every verdict in them is computed from those files when the page is rendered. The
doctor section is static: ``make doctor`` writes no results file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from cs336_systems.paired_stats import paired_median
from cs336_systems.writeup import fmt
from cs336_systems.writeup.allreduce_section import run_heading
from cs336_systems.writeup.analysis import Record, by_variant
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import ddp_run_setting, not_measured_notes
from cs336_systems.writeup.ddp_sections import COMPUTE_ONLY, TORCH_DDP, ddp_setting_line
from cs336_systems.writeup.figures import error_bars, save
from cs336_systems.writeup.load import ResultsFile

MB = 2**20

# ---------------------------------------------------------------------------------------------
# The lever ablation

ABLATION = "ablation"
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

Every variant ran once per round, all in the same interleaved run, so step $i$ of each variant and of the compute-only step ran seconds apart under the same machine load. Each exposed overhead is the median over rounds of (the variant's step − the compute-only step of the same round), and each comparison of two variants is the median of their per-round differences, judged against its 95% interval (distribution-free, from the sign test; `cs336_systems/paired_stats.py`): a difference whose interval contains zero is called *within noise*."""


def _cap_mb(r: Record) -> str:
    """The bucket cap a bucketed variant used: the one "auto" chose, or the one it was given."""
    if r.get("bucket_cap_bytes"):
        return fmt.size_mb(r["bucket_cap_bytes"] / MB)
    if isinstance(r.get("bucket_size_mb"), (int, float)):
        return fmt.size_mb(r["bucket_size_mb"])
    return "–"


def _ratio_to(value_s: float, reference_s: float | None) -> str:
    return "–" if not reference_s or reference_s <= 0 else fmt.ratio(value_s / reference_s)


def _ablation_table(records: list[Record], torch_exposed: float | None) -> str:
    rows = [[r["variant"], VARIANT_MEANING.get(r["variant"], "–"),
             "–" if r.get("n_buckets") is None else r["n_buckets"],
             _cap_mb(r) if r["variant"].startswith("bucketed-") else "–",
             fmt.ms(r["median_step_s"]), f"{fmt.ms(r['min_step_s'])}–{fmt.ms(r['max_step_s'])}",
             fmt.ms(r["exposed_overhead_s"]),
             "–" if r["variant"] == COMPUTE_ONLY else fmt.ms_interval(r.get("exposed_overhead_ci95_s")),
             "–" if r["variant"] == COMPUTE_ONLY else _ratio_to(r["exposed_overhead_s"], torch_exposed)]
            for r in records]
    return fmt.table(["variant", "what it is", "buckets", "bucket cap (MB)", "median step (ms)", "min–max (ms)",
                      "exposed overhead (ms)", "its 95% interval (ms)", "exposed overhead / torch DDP's"], rows,
                     align="llrrrrrrr")


def _paired_difference(a: Record, b: Record) -> tuple[float, str]:
    """(median over rounds of a's step − b's step, whether that stands out from the noise)."""
    difference, interval = paired_median(a["step_times_s"], b["step_times_s"])
    if interval is None:
        return difference, f"too few rounds ({len(a['step_times_s'])}) for a 95% interval"
    lo, hi = interval
    word = "beyond the noise" if lo > 0 or hi < 0 else "within noise"
    return difference, f"{word}: 95% interval {fmt.ms(lo)} to {fmt.ms(hi)} ms"


def _signed_ms(seconds: float) -> str:
    return ("+" if seconds >= 0 else "") + fmt.ms(seconds)


def _goal_sentence(variant: Record, limit: float, torch: Record) -> str:
    exposed, reference = variant["exposed_overhead_s"], torch["exposed_overhead_s"]
    ratio = exposed / reference
    verdict = "holds" if ratio <= limit else "does not hold"
    difference, noise = _paired_difference(variant, torch)
    return (f"{variant['variant']}'s exposed overhead ≤ {limit:g}× torch DDP's: **{verdict}** in this run "
            f"({fmt.ratio(ratio)}: {fmt.ms(exposed)} against {fmt.ms(reference)} ms); its step minus torch DDP's, "
            f"round by round, is {_signed_ms(difference)} ms ({noise}).")


def _ablation_discussion(records: list[Record]) -> str:
    v = by_variant(records)
    floor, torch = v.get(COMPUTE_ONLY), v.get(TORCH_DDP)
    if floor is None:
        return "This run has no compute-only record, so no overhead can be judged."
    out = [f"Noise: the compute-only step alone ranges over {fmt.ms(floor['max_step_s'] - floor['min_step_s'])} ms "
           f"(max − min of its {floor['steps_timed']} timed steps), mostly load that drifts from round to round "
           "and hits every variant of a round alike; the per-round differences below cancel that part."]
    bucketed = [r for r in records if r["variant"].startswith("bucketed-")]
    comparable = torch is not None and torch["exposed_overhead_s"] > 0
    if torch is None:
        out.append("This run has no torch DDP record: the goals, stated against it, cannot be judged.")
    elif not comparable:
        out.append(f"torch DDP's exposed overhead is not positive ({fmt.ms(torch['exposed_overhead_s'])} ms): its "
                   "step was no slower than the compute-only step, so ratios to it are undefined and the goals "
                   "cannot be judged in this run.")
    else:
        for name, limit in GOALS:
            out.append(_goal_sentence(v[name], limit, torch) if name in v
                       else f"The goal for {name} (≤ {limit:g}× torch DDP's) cannot be judged: no record of it.")
    if bucketed:
        best = min(bucketed, key=lambda r: r["exposed_overhead_s"])
        ratio = (f", {fmt.ratio(best['exposed_overhead_s'] / torch['exposed_overhead_s'])} torch DDP's"
                 if comparable else "")
        out.append(f"Lowest exposed overhead of the bucketed variants: {best['variant']}, "
                   f"{fmt.ms(best['exposed_overhead_s'])} ms{ratio}.")
    default = v.get(DEFAULT_BUCKETED)
    levers = [(lever, v[name]) for lever, name in LEVER_OFF if name in v]
    if default is not None and levers:
        parts = []
        for lever, off in levers:
            difference, noise = _paired_difference(off, default)
            parts.append(f"{lever} off ({off['variant']}): {_signed_ms(difference)} ms ({noise})")
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


def _interval_ms(r: Record) -> tuple[float, float] | None:
    interval = r.get("exposed_overhead_ci95_s")
    return (interval[0] * 1e3, interval[1] * 1e3) if interval else None


def exposed_overhead_figure(records: Sequence[Record], title: str, path: Path) -> Path:
    """Exposed overhead per variant (bars with 95% intervals), torch DDP's as a reference line and band."""
    shown = [r for r in records if r["variant"] not in (COMPUTE_ONLY, TORCH_DDP)]
    torch = next((r for r in records if r["variant"] == TORCH_DDP), None)
    height = 0.42 * len(shown) + 1.9
    fig = Figure(figsize=(8.0, height))
    fig.subplots_adjust(left=0.26, right=0.97, bottom=1.0 / height, top=1 - 0.35 / height)
    ax = fig.subplots()
    y = np.arange(len(shown))[::-1]
    values = np.array([r["exposed_overhead_s"] for r in shown]) * 1e3
    intervals = [_interval_ms(r) for r in shown]
    errors = (error_bars(values, np.array([lo for lo, _ in intervals]), np.array([hi for _, hi in intervals]))
              if all(intervals) else None)
    ax.barh(y, values, xerr=errors, capsize=3, color="tab:blue", alpha=0.7,
            label="exposed overhead (median over rounds of step − compute-only step; bars: 95% interval)")
    if torch is not None:
        t = torch["exposed_overhead_s"] * 1e3
        ax.axvline(t, color="tab:red", ls="--", label=f"torch DDP ({fmt.ms(torch['exposed_overhead_s'])} ms)")
        torch_interval = _interval_ms(torch)
        if torch_interval:
            ax.axvspan(*torch_interval, color="tab:red", alpha=0.12, label="torch DDP's 95% interval")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(y, [r["variant"] for r in shown])
    ax.set(xlabel="exposed overhead per step (ms)", title=title)
    ax.grid(True, axis="x", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="lower center", ncols=2)
    return save(fig, path)


def ablation_section(ctx: RenderContext) -> Section:
    out = ["## Beyond: bucketed DDP against torch's DDP (lever ablation)", "", LEVERS_TEXT]
    figures = []
    for machine, results in ctx.inputs.runs(ABLATION):
        records = results.records
        v = by_variant(records)
        torch = v.get(TORCH_DDP)
        path = exposed_overhead_figure(records, f"exposed overhead per variant on {machine.tag}",
                                       ctx.figure_path(f"{machine.tag}_{results.name}_exposed_overhead.png"))
        figures.append(path)
        out += ["", run_heading(machine, results, ABLATION), "", ddp_setting_line(results), "",
                _ablation_table(records, torch["exposed_overhead_s"] if torch else None), "",
                ctx.image(path, f"exposed overhead per variant on {machine.tag}"), "", _ablation_discussion(records)]
    notes = not_measured_notes(ctx.inputs, ABLATION, "Lever ablation (`scripts/bench_ddp.py --ablation`)")
    if notes:
        out += ["", "### Not measured here", "", notes]
    return Section("\n".join(out), figures)


# ---------------------------------------------------------------------------------------------
# Optimizer state sharding: memory, time, communication

SHARDING = "sharded_optimizer"
PHASE_NAMES = (("after_init", "after initialisation"), ("before_step", "directly before `optimizer.step()`"),
               ("after_step", "directly after it"))
BREAKDOWN = ("parameters", "gradients", "optimizer_state", "other")
METHOD_WORDS = {
    "rss": "process RSS high-water mark (VmHWM, reset at each point), above a baseline read before the model "
           "was built",
    "cuda_allocator": "CUDA allocator peak (`torch.cuda.max_memory_allocated`, reset at each point), above a "
                      "baseline read before the model was built",
}
ZERO_CITATION = ("Rajbhandari et al., *ZeRO: Memory Optimizations Toward Training Trillion Parameter Models*, "
                 "SC 2020, Sec. 7.2.1")


def _by_configuration(records: list[Record]) -> dict[str, list[Record]]:
    groups: dict[str, list[Record]] = {}
    for r in sorted(records, key=lambda r: (r.get("configuration", ""), r.get("rank", 0))):
        groups.setdefault(r.get("configuration", "?"), []).append(r)
    order = {"unsharded": 0, "sharded": 1}
    return dict(sorted(groups.items(), key=lambda kv: (order.get(kv[0], 2), kv[0])))


def _phase_peak(r: Record, phase: str) -> float | None:
    return ((r.get("phases") or {}).get(phase) or {}).get("peak_above_baseline_bytes")


def _memory_tables(groups: dict[str, list[Record]]) -> list[str]:
    peaks = fmt.table(["configuration", "rank", *(f"peak {words} (MB)" for _, words in PHASE_NAMES),
                       "baseline (MB)"],
                      [[c, r.get("rank"), *(fmt.mb(_phase_peak(r, p)) for p, _ in PHASE_NAMES),
                        fmt.mb(r.get("baseline_bytes"))] for c, rs in groups.items() for r in rs], align="lrrrrr")
    rows = []
    for c, rs in groups.items():
        for r in rs:
            after = (r.get("phases") or {}).get("after_step") or {}
            parts = after.get("breakdown") or {}
            rows.append([c, r.get("rank"), *(fmt.mb(parts.get(k)) for k in BREAKDOWN),
                         fmt.mb(after.get("peak_above_baseline_bytes"))])
    breakdown = fmt.table(["configuration", "rank", "parameters (MB)", "gradients (MB)", "optimizer state (MB)",
                           "other (MB)", "peak above baseline (MB)"], rows, align="lrrrrrr")
    return [peaks, "", "What the peak directly after the step holds (tensor bytes counted storage by storage; "
                       "*other* is the rest of the peak: activations, temporaries, communication buffers, allocator "
                       "slack):", "", breakdown]


def _state_table(groups: dict[str, list[Record]]) -> str:
    rows = []
    for c, rs in groups.items():
        for r in rs:
            measured, expected = r.get("measured_optimizer_state_bytes"), r.get("expected_optimizer_state_bytes")
            bound = r.get("expected_optimizer_state_imbalance_bound_bytes")
            owned = f"{r.get('owned_parameters', '–')} of {r.get('n_parameter_tensors', '–')}"
            rows.append([c, r.get("rank"), owned,
                         fmt.mb(measured), fmt.mb(expected),
                         fmt.ratio(measured / expected) if measured and expected else "–",
                         fmt.mb(bound) if bound else "–"])
    return fmt.table(["configuration", "rank", "parameter tensors owned", "optimizer state measured (MB)",
                      "expected 2B/n (MB)", "measured / expected", "bound on a shard's excess (MB)"], rows,
                     align="lrrrrrr")


def _max_over_ranks(records: list[Record], get) -> float | None:
    values = [get(r) for r in records if get(r) is not None]
    return max(values) if values else None


def _memory_sentences(groups: dict[str, list[Record]], world_size: int) -> list[str]:
    if "unsharded" not in groups or "sharded" not in groups:
        return [f"This run lacks the {'sharded' if 'unsharded' in groups else 'unsharded'} configuration: "
                "nothing to compare."]
    u, s = groups["unsharded"], groups["sharded"]
    out = []
    u_state = _max_over_ranks(u, lambda r: r.get("measured_optimizer_state_bytes"))
    s_state = _max_over_ranks(s, lambda r: r.get("measured_optimizer_state_bytes"))
    if u_state and s_state:
        out.append(f"Optimizer state on the fullest rank: {fmt.mb(s_state)} MB sharded against {fmt.mb(u_state)} MB "
                   f"unsharded, {fmt.ratio(s_state / u_state)} (1/n = {fmt.sig(1 / world_size)} on {world_size} "
                   "ranks; the shards are whole parameters, so a rank can hold more than 1/n).")
    for phase, words in PHASE_NAMES:
        up = _max_over_ranks(u, lambda r: _phase_peak(r, phase))
        sp = _max_over_ranks(s, lambda r: _phase_peak(r, phase))
        if up is None or sp is None:
            continue
        change = "lower" if sp < up else "higher"
        out.append(f"Peak {words}, largest over ranks: {fmt.mb(sp)} MB sharded, {fmt.mb(up)} MB unsharded "
                   f"({fmt.mb(abs(up - sp))} MB {change} with sharding).")
    return out


def _time_part(groups: dict[str, list[Record]]) -> list[str]:
    rows, medians = [], {}
    for c, rs in groups.items():
        r = rs[0]  # every rank records the same slowest-rank times
        medians[c] = (r.get("median_step_s"), r.get("median_optimizer_step_s"))
        rows.append([c, len(r.get("step_times_s") or []), fmt.ms(r.get("median_step_s")),
                     fmt.ms(r.get("median_optimizer_step_s"))])
    out = [fmt.table(["configuration", "steps timed", "median step (ms)", "median `optimizer.step()` (ms)"], rows)]
    if "unsharded" in medians and "sharded" in medians and all(medians["unsharded"]) and all(medians["sharded"]):
        (us, uo), (ss, so) = medians["unsharded"], medians["sharded"]
        out += ["", f"Sharded against unsharded: step {fmt.ratio(ss / us)} ({fmt.ms(ss)} vs {fmt.ms(us)} ms), "
                    f"`optimizer.step()` {fmt.ratio(so / uo)} ({fmt.ms(so)} vs {fmt.ms(uo)} ms); the sharded "
                    "optimizer step updates only this rank's parameters but includes broadcasting them to the "
                    "other ranks."]
        fresh = [r.get("fresh_process") for rs in groups.values() for r in rs]
        if all(fresh):
            out[-1] += (" Each configuration ran in its own launch (fresh processes, so that no configuration "
                        "inherits another's heap): this comparison is across launches, and includes their "
                        "launch-to-launch variation.")
    return out


def _communication_part(meta: dict, groups: dict[str, list[Record]], world_size: int) -> list[str]:
    comm = meta.get("communication_bytes_per_rank") or {}
    b = comm.get("parameter_bytes")
    if not b or world_size < 1:
        return ["The run's meta has no parameter bytes B: no communication figures."]
    n = world_size
    share = (n - 1) / n * b
    ddp = 2 * share
    rows = [["DDP (gradient all-reduce)", "2(n−1)/n · B", fmt.mb(ddp), "1×" if ddp else "–"],
            ["this repo: DDP + sharded optimizer's parameter broadcasts", "2(n−1)/n · B + (n−1)/n · B",
             fmt.mb(3 * share), fmt.ratio(1.5) if ddp else "–"],
            ["ZeRO stage 1 as in the paper: reduce-scatter gradients, all-gather parameters",
             "(n−1)/n · B + (n−1)/n · B", fmt.mb(ddp), "1×" if ddp else "–"]]
    out = [f"Bytes each rank sends (and receives) per step, by the ring formulas, for B = {fmt.mb(b)} MB of "
           f"parameters (float32) and n = {n} ranks:", "",
           fmt.table(["scheme", "formula", "bytes per rank per step (MB)", "relative to DDP"], rows, align="llrr"),
           "",
           "This repo's `ShardedOptimizer` keeps DDP's all-reduce (every rank gets every averaged gradient) and "
           "then broadcasts each updated parameter from its owner: (n−1)/n · B more, 1.5× DDP's volume. The ZeRO "
           "paper's stage 1 reduce-scatters the gradients instead, so each rank receives only the averaged "
           "gradients of the parameters it owns, and all-gathers the updated parameters: the same 2(n−1)/n · B as "
           f"DDP ({ZERO_CITATION})."]
    received = [(r.get("rank"), (r.get("communication_bytes_per_rank") or {}).get("parameter_broadcast_received"))
                for r in groups.get("sharded", [])]
    received = [(rank, x) for rank, x in received if x is not None]
    if received:
        listed = ", ".join(f"rank {rank} {fmt.mb(x)} MB" for rank, x in received)
        out[-1] += (f" Exactly, each rank receives the parameters it does not own: {listed} (against the formula's "
                    f"{fmt.mb(share)} MB; shards are whole parameters).")
    return out


def _sharding_setting_line(results: ResultsFile) -> str:
    meta = results.meta
    setting = meta.get("setting") or {}
    backend, device = ddp_run_setting(meta)
    n_params = meta.get("n_parameters")
    model = f"model {setting.get('model_size', '?')}" + (f" ({fmt.sig(n_params / 1e6)}M parameters)" if n_params
                                                          else "")
    parts = [f"backend {backend}", f"world size {setting.get('world_size', meta.get('world_size', '?'))}", model,
             f"batch {setting.get('batch_per_rank', '?')} per rank × context {setting.get('context_length', '?')}",
             f"AdamW, {setting.get('steps', '?')} timed steps after {setting.get('warmup_steps', '?')} warm-up"]
    return fmt.setting_line(meta, results.source, device_type=device, parts=parts)


def sharding_accounting_section(ctx: RenderContext) -> Section:
    out = ["## optimizer_state_sharding_accounting: memory and time with and without optimizer state sharding", "",
           "The same data-parallel training steps (naive DDP, which keeps no gradient copies) with `torch.optim.AdamW` "
           "on every rank (*unsharded*) and with our `ShardedOptimizer` over AdamW (*sharded*: each rank keeps the "
           "state of the parameters it owns and broadcasts them after updating). Memory is read after "
           "initialisation, directly before the optimizer step and directly after it, on the last timed step; "
           "each figure is the peak since the previous point, per rank."]
    for machine, results in ctx.inputs.runs(SHARDING):
        groups = _by_configuration(results.records)
        meta = results.meta
        world_size = int((meta.get("setting") or {}).get("world_size", meta.get("world_size", 1)))
        methods = sorted({r.get("method", meta.get("memory_method", "?")) for r in results.records})
        method_text = "; ".join(f"{METHOD_WORDS.get(m, 'an unknown method')} (method `{m}`)" for m in methods)
        out += ["", run_heading(machine, results, SHARDING), "", _sharding_setting_line(results), "",
                f"Memory: {method_text}.", "", "#### Peak memory", "", *_memory_tables(groups), "",
                "\n".join(f"- {s}" for s in _memory_sentences(groups, world_size)), "",
                "#### Optimizer state per rank", "",
                "Expected: AdamW's two float32 moments, 2B for B parameter bytes, or 2B/n per rank when sharded; the "
                "measured figure adds a scalar `step` per parameter, and a shard may exceed the average by at most "
                "the moments of the largest parameter (the bound column).", "", _state_table(groups), "",
                "#### Step time", "", *_time_part(groups), "",
                "#### Communication per step", "", *_communication_part(meta, groups, world_size)]
    notes = not_measured_notes(ctx.inputs, SHARDING, "Optimizer state sharding accounting")
    if notes:
        out += ["", "### Not measured here", "", notes]
    return Section("\n".join(out))


# ---------------------------------------------------------------------------------------------
# The doctor (static: it writes no results file)

DOCTOR_TEXT = """## Beyond: make doctor

`make doctor` runs one short diagnostic job (2 ranks with gloo on this machine by default; `scripts/doctor.py` shows the torchrun and SLURM forms, and `--device cuda` for GPUs) and checks a data-parallel set-up rank by rank (`cs336_systems/doctor.py`):

- **check-in**: every rank writes a key to the rendezvous store; rank 0 names the ranks missing after a timeout (a store key, unlike a collective, says *which* rank is absent).
- **stragglers**: each rank times the compute of a few training steps, before waiting for gradients, since in DDP every rank's step includes waiting for the slowest.
- **data shards**: every rank's `DistributedSampler` indices are gathered and checked for overlaps and for samples no rank gets.
- **replica agreement**: checksums of every parameter are compared across ranks before any broadcast, after wrapping in DDP, and after the training steps.
- **all-reduce cost**: a short calibration fits time = $o$ + bytes / $w$ and suggests the bucket size $\\sqrt{s\\,w\\,o}$ for the model's $s$ gradient bytes.

It prints a per-rank table and, for each problem, a plain-language finding with the values seen and the usual cause; it exits 1 when it finds anything, 0 with an OK summary otherwise (2 for bad arguments). It writes no results file, so nothing of it is measured on this page. To see what each finding looks like, plant a known fault:

- `make doctor DOCTOR_ARGS="--inject overlapping-shards"`: every rank builds its sampler as if it were rank 0;
- `make doctor DOCTOR_ARGS="--inject unseeded-no-broadcast"`: each rank seeds differently and the model trains unwrapped;
- `make doctor DOCTOR_ARGS="--inject straggler"`: rank 1 sleeps in every step;
- `make doctor DOCTOR_ARGS="--inject missing-rank --checkin-timeout-s 3"`: rank 1 checks in only after rank 0 has given up on it."""


def doctor_section(ctx: RenderContext) -> Section:
    return Section(DOCTOR_TEXT)


BEYOND_SECTIONS = [ablation_section, sharding_accounting_section, doctor_section]
