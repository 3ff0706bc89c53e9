"""Problem 6a: the bucket-size sweep, and the handout's question answered from the run.

The handout asks whether the sweep matches expectations, why not, and what change to the setup
would make it match. The answer is generated from the numbers: every comparison is a paired
difference with its 95% interval (paired.py), the verdict follows from which differences
exclude zero, the reasons come from this run's bucket plan (bucket_plan.py), the machine's
profile (profile_section.py) and its threads and cores, and the suggested change from the same
counts (how many cores the ranks' compute and gloo's threads would need).
"""

from __future__ import annotations

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import COMPUTE_ONLY, TORCH_DDP
from cs336_systems.writeup import fmt
from cs336_systems.writeup.bucket_plan import large_cap_explanation, parameter_shapes, plan_text
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.ddp_analysis import bucket_sweep, by_variant, gradient_bytes
from cs336_systems.writeup.ddp_figures import bucket_sweep_figure
from cs336_systems.writeup.load import MachineResults, ResultsFile
from cs336_systems.writeup.paired import Paired, listed, paired, paired_table
from cs336_systems.writeup.profile_section import PROFILE_KIND, overlap_cost
from cs336_systems.writeup.step_setting import gpu_notes
from cs336_systems.writeup.step_tables import VARIANT_HEADERS, ddp_section, pick, variant_row, variant_table

REFERENCES = ["per-parameter", "flat", TORCH_DDP, COMPUTE_ONLY]
EXPECTATION = (
    "What one expects: bucketing sits between per-parameter DDP (one call per parameter, each paying the per-call "
    "cost, all overlapped with backward) and flat DDP (one call, nothing overlapped). Small buckets should pay many "
    "per-call costs, large ones should leave more communication after backward, so some intermediate size should "
    "beat both per-parameter and flat DDP, and the largest caps should approach flat."
)


def _name(r: StepRecord) -> str:
    return f"{fmt.size_mb(r.bucket_size_mb)} MB" if r.bucket_size_mb is not None else r.variant


def comparisons(sweep: list[StepRecord], v: dict[str, StepRecord]) -> list[Paired]:
    """Each size against the next larger one, then against torch DDP, per-parameter and flat."""
    out = [paired(b, a) for a, b in zip(sweep, sweep[1:])]
    for reference in (TORCH_DDP, "per-parameter", "flat"):
        if reference in v:
            out += [paired(r, v[reference]) for r in sweep]
    return out


def _beats(sweep: list[StepRecord], reference: StepRecord | None) -> list[StepRecord]:
    """Sizes whose step is shorter than ``reference``'s with an interval that excludes zero."""
    if reference is None:
        return []
    return [r for r in sweep if (d := paired(r, reference)).resolved and d.median_s < 0]


def sweep_verdict(sweep: list[StepRecord], v: dict[str, StepRecord], differences: list[Paired]) -> str:
    """"**Does the sweep match that?** Yes/Only in part/No: ..." from which differences exclude zero."""
    adjacent = differences[:len(sweep) - 1]
    flat, per_parameter = _beats(sweep, v.get("flat")), _beats(sweep, v.get("per-parameter"))
    told_apart = [d for d in adjacent if d.resolved]
    if not adjacent:
        sizes = "one size only, so the sizes are not compared"
    elif len(told_apart) == len(adjacent):
        sizes = "every difference between neighbouring sizes excludes zero"
    elif told_apart:
        sizes = (f"{len(told_apart)} of the {len(adjacent)} differences between neighbouring sizes exclude zero "
                 f"({listed([f'{d.a} − {d.b}' for d in told_apart])})")
    else:
        sizes = (f"none of the {len(adjacent)} differences between neighbouring sizes excludes zero: the sizes are "
                 "indistinguishable here")
    beats = []
    for what, found in (("flat", flat), ("per-parameter", per_parameter)):
        if what in v:
            beats.append(f"{listed([_name(r) for r in found])} {'has' if len(found) == 1 else 'have'} a step resolved "
                         f"shorter than {what}'s" if found else f"no size has a step resolved shorter than {what}'s")
    word = "Yes" if flat and per_parameter else "Only in part" if flat or per_parameter else "No"
    return f"**Does the sweep match that?** {word}: {sizes}; {'; '.join(beats)} (table above)."


def _noise(differences: list[Paired]) -> str | None:
    with_interval = [d for d in differences if d.interval_s is not None]
    if not with_interval:
        return None
    unresolved = [d for d in with_interval if not d.resolved]
    width = sorted(d.interval_s[1] - d.interval_s[0] for d in with_interval)  # type: ignore[index]
    size = sorted(abs(d.median_s) for d in with_interval)
    return (f"Noise: {len(unresolved)} of the {len(with_interval)} comparisons are indistinguishable here; their 95% "
            f"intervals are {fmt.ms(width[len(width) // 2])} ms wide (median), against median differences of "
            f"{fmt.ms(size[len(size) // 2])} ms, from {with_interval[0].rounds} rounds.")


def _change(results: ResultsFile, noisy: bool) -> str:
    """What setup would give the expected shape, computed from this run's ranks, threads and cores."""
    env, notes = results.environment, results.notes
    ranks = notes.get("ranks_on_node") or env.world_size
    threads, cores = notes.get("threads_per_rank"), env.cpu_count
    changes = []
    if env.device_type == "cpu":
        if threads and cores and ranks * (threads + 1) > cores:
            changes.append(f"Give communication cores of its own: the same {ranks} ranks × {threads} compute "
                           f"thread{'s' if threads != 1 else ''} plus one gloo thread each need {ranks * (threads + 1)} "
                           f"cores, this machine has {cores}")
        changes.append("Or, as the handout intends, NCCL with one GPU per rank (`make bench-gpu` on a node with 2 "
                       "GPUs), where the all-reduce runs on the GPUs' links beside the compute kernels instead of "
                       "taking compute's cores")
    elif env.shared_gpu or "gloo" in env.backend:
        changes.append("One GPU per rank with NCCL (`make bench-gpu` on a node with 2 GPUs), so that ranks compute "
                       "at the same time and the all-reduce stays on the GPUs")
    if noisy:
        changes.append(f"More rounds than this run's {results.setting.get('rounds', '?')}, so that the intervals "
                       "narrow enough to order the sizes")
    changes.append("`first_bucket_mb=None` for the caps above s, if they are to show the one-bucket limit")
    return "**What change would make it match?**\n\n" + "\n".join(f"- {c}." for c in changes)


def _answer(machine: MachineResults, results: ResultsFile, sweep: list[StepRecord], v: dict[str, StepRecord],
            differences: list[Paired]) -> str:
    shapes = parameter_shapes(results.setting)
    s_bytes = gradient_bytes(results)
    reasons = [_noise(differences)]
    profile = machine.runs(PROFILE_KIND)
    if profile and results.environment.world_size > 1:
        reasons.append(overlap_cost(profile[0]))
    reasons += gpu_notes(results.environment)
    if s_bytes and shapes:
        reasons.append(large_cap_explanation(sweep, s_bytes, shapes))
    found = [r for r in reasons if r]
    verdict = sweep_verdict(sweep, v, differences)
    matches = "** Yes:" in verdict
    out = [EXPECTATION, "", verdict, "", "**What else bends it here:**" if matches else "**Why not?**", ""]
    out += [f"- {r}" for r in found] if found else ["- This run holds nothing that explains it."]
    if not matches:
        noisy = any(not d.resolved for d in differences)
        out += ["", _change(results, noisy)]
    return "\n".join(out)


def _plans(sweep: list[StepRecord], results: ResultsFile) -> str:
    shapes = parameter_shapes(results.setting)
    lines = [f"- {plan_text(r, shapes)}" for r in sweep]
    return "The buckets each cap built, in launch order (the order gradients became ready in the first step):\n\n" + \
        "\n".join(lines)


def bucketed_benchmarking_section(ctx: RenderContext) -> Section:
    def body(machine: MachineResults, results: ResultsFile):
        sweep = bucket_sweep(results.records)
        references = pick(results.records, REFERENCES)
        if not sweep:
            return f"{variant_table(references)}\n\nThis run has no bucketed variant.", []
        v = by_variant(results.records)
        sweep_table = fmt.table(["bucket size (MB)", *VARIANT_HEADERS],
                                [[fmt.size_mb(r.bucket_size_mb), *variant_row(r)] for r in sweep])
        path = bucket_sweep_figure(sweep, {r.variant: r for r in references},
                                   f"bucket sweep, model {results.setting.get('model_size', '')} on {machine.tag}",
                                   ctx.figure_path(f"{machine.tag}_{results.name}_bucket_sweep.png"))
        differences = comparisons(sweep, v)
        text = [sweep_table, "", "Other variants of the same run, for reference:", "", variant_table(references), "",
                ctx.image(path, f"bucket sweep on {machine.tag}"), "",
                "Every comparison, as the median of per-round step differences with its 95% interval:", "",
                paired_table(differences), "", _plans(sweep, results), "",
                _answer(machine, results, sweep, v, differences)]
        return "\n".join(text), [path]

    return ddp_section(ctx, "## ddp_bucketed_benchmarking: bucket size sweep",
                       "Bucketed DDP with each bucket size of the sweep, beside per-parameter, flat and PyTorch's "
                       "`DistributedDataParallel` at its default bucket size, all from the same run (columns as "
                       "defined under naive_ddp_benchmarking).", body)
