"""Beyond the handout: ``bucket_size_mb="auto"`` against the 25 MB default on a family of model shapes.

Built from ``bucket_family.json`` (``scripts/bench_bucket_family.py``): per model, compute-only, bucketed-auto,
bucketed-25MB and torch DDP from one interleaved run, what auto measured and kept, and auto − 25 MB paired
round by round (:mod:`.paired`). Numbers only; the words are in ``templates/details/auto_bucket.md.j2``.
"""

from __future__ import annotations

from cs336_systems.bench.family.record import FamilyRecord
from cs336_systems.bench.family.run import AUTO_VARIANT, DEFAULT_VARIANT
from cs336_systems.bench.step.variants import TORCH_DDP
from cs336_systems.ddp.auto_bucket import TUNING_ROUNDS
from cs336_systems.writeup import coverage, fmt, templating
from cs336_systems.writeup.context import Page, RenderContext
from cs336_systems.writeup.paired import paired, signed_ms


def _model(r: FamilyRecord, unfit: str | None) -> dict:
    by = {s.variant: s for s in r.steps}
    d = paired(by[AUTO_VARIANT], by[DEFAULT_VARIANT], unfit)
    same = by[AUTO_VARIANT].bucket_bytes == by[DEFAULT_VARIANT].bucket_bytes
    exposed = [f"{fmt.ms(s.exposed_overhead_s)} ({fmt.ms_interval(s.exposed_overhead_ci95_s)})"
               for s in (by[AUTO_VARIANT], by[DEFAULT_VARIANT], by[TORCH_DDP])]
    timed = ", ".join(f"{fmt.mb(c)}" + ("" if m is None else f": {fmt.ms(m)}")
                      for c, m in zip(r.candidate_caps_bytes, r.candidate_median_s))
    return dict(
        name=r.model, d=d, same=same, kept_default=r.chosen_cap_bytes == r.candidate_caps_bytes[0],
        only_default=len(r.candidate_caps_bytes) == 1,
        shape=[f"`{r.model}`", r.shape, fmt.sig(r.n_parameters / 1e6) + "M", r.n_tensors, fmt.mb(r.gradient_bytes),
               fmt.mb(r.largest_parameter_bytes), f"{r.global_batch} × {r.context_length}"],
        tuning=[f"`{r.model}`", fmt.us(r.calibration_o_s), fmt.gbps(r.calibration_w_bytes_per_s),
                fmt.mb(r.model_cap_bytes), timed, f"**{fmt.mb(r.chosen_cap_bytes)}**", r.tuning_steps],
        result=[f"`{r.model}`", *exposed, f"{signed_ms(d.median_s)} ({fmt.ms_interval(d.interval_s)})",
                d.reading + (" (same buckets)" if same else "")])


def _run(machine, results) -> dict:
    unfit = fmt.not_evidence(results.environment)
    models = [_model(r, unfit) for r in results.records]
    env, threads = results.environment, results.notes.get("threads_per_rank")
    warmup = results.setting.get("warmup_steps", 0)
    return dict(
        heading=fmt.run_heading(machine, results), env=env, threads=threads, models=models, unfit=unfit,
        setting=fmt.setting_line(env, results.source, parts=[
            f"backend {env.backend}", f"world size {env.world_size}", f"{results.setting.get('rounds', '?')} "
            f"interleaved rounds, {warmup} warm-up step{'s' if warmup != 1 else ''} per variant"]),
        shapes=fmt.table(["model", "shape", "parameters", "tensors", "s (MB)", "largest parameter (MB)",
                          "global batch × context"], [m["shape"] for m in models], align="llrrrrl"),
        tuning=fmt.table(["model", "o (µs)", "w (GB/s)", "model's cap (MB)",
                          "caps timed, 25 MB's layout first (MB: median tuning step, ms)", "kept (MB)",
                          "tuning steps"], [m["tuning"] for m in models], align="lrrrlrr"),
        results=fmt.table(["model", "auto: exposed overhead (ms; 95% interval)", "25 MB: exposed overhead",
                           "torch DDP: exposed overhead", "auto − 25 MB per round (ms; 95% interval)", "reading"],
                          [m["result"] for m in models], align="lrrrrl"))


def family_page(ctx: RenderContext) -> Page:
    found = ctx.inputs.runs(FamilyRecord.KIND)
    runs = [_run(m, f) for m, f in found if f.records]
    missing = [s.name for s in coverage.note_gaps(ctx, FamilyRecord.KIND, "the auto bucket size on a family of "
                                                  "model shapes (`scripts/bench_bucket_family.py`)")]
    markdown = templating.render("details/auto_bucket.md.j2", runs=runs, missing=missing, rounds=TUNING_ROUNDS,
                                 gaps="machines.md#not-measured-here")
    return Page("auto_bucket", markdown)
