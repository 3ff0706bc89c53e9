"""Beyond the handout: ``bucket_size_mb="auto"`` against the 25 MB default on a family of model shapes.

Built from ``bucket_family.json`` (``scripts/bench_bucket_family.py``): per model, the step
benchmark's records of compute-only, bucketed-auto, bucketed-25MB and torch DDP from one
interleaved run, what auto measured and kept, and auto − 25 MB paired round by round. Every
comparison goes through :mod:`cs336_systems.writeup.paired`, so its words follow its interval.
"""

from __future__ import annotations

from cs336_systems.bench.family.record import FamilyRecord
from cs336_systems.bench.family.run import AUTO_VARIANT, DEFAULT_VARIANT
from cs336_systems.bench.step.variants import TORCH_DDP
from cs336_systems.ddp.auto_bucket import TUNING_ROUNDS
from cs336_systems.writeup import fmt
from cs336_systems.writeup.allreduce_analysis import ranks_per_core
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import CPU
from cs336_systems.writeup.load import ResultsFile
from cs336_systems.writeup.paired import Paired, difference_clause, listed, paired

HEADING = '## Beyond: `bucket_size_mb="auto"` on a family of model shapes'

INTRO = (
    '`bucket_size_mb="auto"` (`cs336_systems/ddp/auto_bucket.py`) lets each job choose its own cap. At construction '
    "it times a few all-reduces on the job's own process group and fits $o$ and $w$; the overhead model's cap "
    "$\\min(\\sqrt{s\\,w\\,o}, s)$ (section above) trains the first step. The model alone is not trusted with the "
    "choice: it assumes backward produces gradients as fast as the channel moves them and that communication costs "
    "compute nothing, and on a machine where that fails a cap a few times off its best can lose to torch's fixed "
    "25 MB. So after the first step, the distinct bucket layouts among four candidates (25 MB, the model's cap, "
    f"half and double it) are each trained for {TUNING_ROUNDS} steps, one per round (steps timed from forward to the "
    "end of synchronisation, slowest rank, agreed by all ranks). 25 MB's layout is kept unless another beat it in "
    f"every round, which a layout no faster than it does at most once in {2 ** TUNING_ROUNDS} tunings (a sign test); "
    "among those that did, the one that gained most per round is kept.\n\n"
    "One rule must serve gradients that come in very different pieces, so it is tested on a family of shapes. Each "
    "model is timed in one run with compute-only, bucketed-auto, bucketed-25MB and torch's DDP, interleaved round "
    "by round (the step benchmark's variants and training step, `cs336_systems/bench/family/`); bucketed-auto is "
    "warmed up through its tuning steps first, so its timed steps use the cap it kept, as a long training run "
    "would. Each step's time is the slowest rank's; auto − 25 MB is the median of the per-round differences with "
    "its 95% sign-test interval."
)


def _by_variant(r: FamilyRecord) -> dict:
    return {s.variant: s for s in r.steps}


def comparison(r: FamilyRecord) -> Paired:
    """auto − 25 MB, paired round by round."""
    by = _by_variant(r)
    return paired(by[AUTO_VARIANT], by[DEFAULT_VARIANT])


def same_layout(r: FamilyRecord) -> bool:
    """Whether auto kept buckets identical to 25 MB's."""
    by = _by_variant(r)
    return by[AUTO_VARIANT].bucket_bytes == by[DEFAULT_VARIANT].bucket_bytes


def _setting_line(results: ResultsFile) -> str:
    env, setting = results.environment, results.setting
    threads = results.notes.get("threads_per_rank")
    parts = [f"backend {env.backend}", f"world size {env.world_size}"]
    if threads:
        parts.append(f"{threads} compute thread{'s' if threads != 1 else ''} per rank")
    rounds = setting.get("rounds")
    if rounds:
        warmup = setting.get("warmup_steps", 0)
        parts.append(f"{rounds} interleaved rounds of one step per variant, {warmup} warm-up "
                     f"step{'' if warmup == 1 else 's'} each (auto: after its tuning steps)")
    return fmt.setting_line(env, results.source, parts=parts)


def _crowding(results: ResultsFile) -> str | None:
    env, threads = results.environment, results.notes.get("threads_per_rank")
    if env.device_type != "cpu" or not env.cpu_count or not threads:
        return None
    busy = env.world_size * threads
    if busy > env.cpu_count:
        return (f"The {env.world_size} ranks × {threads} threads outnumber the {env.cpu_count} cores "
                f"({fmt.sig(ranks_per_core(busy, env.cpu_count))} threads per core): steps are oversubscribed.")
    return (f"The {env.world_size} ranks × {threads} thread{'s' if threads != 1 else ''} fill the {env.cpu_count} "
            "cores, so gloo's communication threads compete with compute for them.")


def _models_table(records: list[FamilyRecord]) -> str:
    rows = [[f"`{r.model}`", r.shape, fmt.sig(r.n_parameters / 1e6) + "M", r.n_tensors, fmt.mb(r.gradient_bytes),
             fmt.mb(r.largest_parameter_bytes), f"{r.global_batch} × {r.context_length}"] for r in records]
    return fmt.table(["model", "shape", "parameters", "tensors", "s (MB)", "largest parameter (MB)",
                      "global batch × context"], rows, align="llrrrrl")


def _tuning_table(records: list[FamilyRecord]) -> str:
    rows = []
    for r in records:
        timed = ", ".join(f"{fmt.mb(c)} MB" + (" (25 MB's layout)" if i == 0 else "")
                          + ("" if m is None else f": {fmt.ms(m)} ms")
                          for i, (c, m) in enumerate(zip(r.candidate_caps_bytes, r.candidate_median_s)))
        rows.append([f"`{r.model}`", fmt.us(r.calibration_o_s), fmt.gbps(r.calibration_w_bytes_per_s),
                     fmt.mb(r.model_cap_bytes), timed, f"**{fmt.mb(r.chosen_cap_bytes)}**", r.tuning_steps])
    return fmt.table(["model", "o (µs)", "w (GB/s)", "model's cap (MB)",
                      "layouts timed (cap: median tuning step)", "kept (MB)", "tuning steps"], rows, align="lrrrlrr")


def _results_table(records: list[FamilyRecord]) -> str:
    rows = []
    for r in records:
        by, d = _by_variant(r), comparison(r)
        cells = [f"`{r.model}`"]
        for name in (AUTO_VARIANT, DEFAULT_VARIANT, TORCH_DDP):
            s = by[name]
            cells += [f"{fmt.ms(s.exposed_overhead_s)} ({fmt.ms_interval(s.exposed_overhead_ci95_s)})"]
        reading = d.reading + (" (same buckets)" if same_layout(r) else "")
        rows.append(cells + [fmt.ms(d.median_s), fmt.ms_interval(d.interval_s), reading])
    return fmt.table(["model", "auto: exposed overhead, ms (95% interval)", "25 MB: exposed overhead, ms (95% interval)",
                      "torch DDP: exposed overhead, ms (95% interval)", "auto − 25 MB per round (ms)",
                      "its 95% interval (ms)", "reading"], rows, align="lrrrrrl")


def family_sentences(records: list[FamilyRecord]) -> list[str]:
    """The verdict on every model, then the summary over the family, worded by the intervals."""
    out = []
    for r in records:
        d = comparison(r)
        text = f"`{r.model}`: {difference_clause(d)}."
        if same_layout(r):
            text += " Auto kept the same buckets as 25 MB, so the two variants differ only by noise."
        out.append(text)
    kept = [r for r in records if r.chosen_cap_bytes == r.candidate_caps_bytes[0]]
    if kept:
        out.append(f"Auto kept 25 MB's layout on {len(kept)} of the {len(records)} models ("
                   + listed([f"`{r.model}`" for r in kept]) + "): no other layout beat it in every tuning round"
                   + (", or no other layout existed." if any(len(r.candidate_caps_bytes) == 1 for r in kept) else "."))
    slower = [f"`{r.model}`" for r in records if comparison(r).resolved and comparison(r).median_s > 0]
    faster = [f"`{r.model}`" for r in records if comparison(r).resolved and comparison(r).median_s < 0]
    unresolved = [f"`{r.model}`" for r in records if comparison(r).interval_s is None]
    if slower:
        summary = f"Auto is slower than 25 MB beyond the noise on {listed(slower)}."
    elif unresolved:
        summary = (f"Too few rounds for an interval on {listed(unresolved)}: the family does not show whether auto "
                   "ever loses to 25 MB.")
    else:
        summary = "On no model of the family is auto slower than 25 MB beyond the noise"
        summary += f"; it is faster on {listed(faster)}." if faster else "."
    return out + [summary]


def _run_part(results: ResultsFile) -> list[str]:
    records: list[FamilyRecord] = results.records
    out = ["", _setting_line(results), ""]
    crowd = _crowding(results)
    if crowd:
        out += [crowd, ""]
    out += ["The models:", "", _models_table(records), "", "What auto measured and kept (its calibration, the "
            "distinct layouts it timed, each with the median of its tuning steps):", "", _tuning_table(records), "",
            "Exposed overhead (step − compute-only step of the same round, median and 95% interval) and auto against "
            "25 MB:", "", _results_table(records), "", *[f"- {s}" for s in family_sentences(records)]]
    return out


def family_section(ctx: RenderContext) -> Section:
    out = [HEADING, "", INTRO]
    runs = ctx.inputs.runs(FamilyRecord.KIND)
    for machine, results in runs:
        out += ["", fmt.run_heading(machine, results)]
        out += _run_part(results) if results.records else ["", "The run holds no model."]
    if not any(r.records for _, r in runs):
        out += ["", f"- The model family, {CPU.name} (`{CPU.backend}`): **not measured here**; `{CPU.command}` "
                f"({CPU.where}) fills it."]
    return Section("\n".join(out))
