"""Beyond the handout: the tuning guides' DDP claims, measured through Lightning (``lightning_claims.json``).

The run is ``scripts/bench_lightning.py`` (cs336_systems/bench/claims/); the verdicts are the
library's (claims/verdicts.py), so the page and the script's console table agree. Numbers
only; the words are in ``templates/details/lightning_claims.md.j2``.
"""

from __future__ import annotations

import dataclasses
import shlex

from cs336_systems.bench.claims.configs import CONFIGS
from cs336_systems.bench.claims.record import ClaimsRecord
from cs336_systems.bench.claims.verdicts import (
    BATCHNORM_TOLERANCE, FAILS, HOLDS, NOT_EVIDENCE, UNRESOLVED, batchnorm_verdict, judge_all)
from cs336_systems.bench.suites import claims_gpu_args
from cs336_systems.writeup import fmt, templating
from cs336_systems.writeup.context import Page, RenderContext

FLOAT32_BYTES = 4
OUTSIDE = "outside the claim's domain (no bf16 GPU)"
KIND = ClaimsRecord.KIND
SCRIPT = "scripts/bench_lightning.py"


def _ci(interval: tuple[float, float] | None, digits: int = 3) -> str:
    return "too few rounds" if interval is None else f"{interval[0]:.{digits}f}–{interval[1]:.{digits}f}"


def not_evidence_reason(results) -> str | None:
    """Why a claims run's timings are not evidence (fmt.not_evidence, the rule of every page), or None."""
    load, why = results.environment.load, fmt.not_evidence(results.environment)
    return None if why is None else why if load is None else f"taken at {load.describe()}: {why}"


def _outside_domain(v, env):
    """A bf16 claim ("on GPUs that support it") measured on a CPU is outside its domain, not refuted."""
    if env.device_type == "cpu" and v.claim.knob.startswith("precision") and v.verdict in (HOLDS, FAILS):
        return dataclasses.replace(v, verdict=OUTSIDE)
    return v


def _run(machine, results) -> dict:
    records: list[ClaimsRecord] = results.records
    loaded = not_evidence_reason(results)
    per_process = bool(results.notes.get("fit_per_process"))
    verdicts = [_outside_domain(v, results.environment)
                for v in judge_all(records, memory_evidence=per_process, speed_evidence=loaded is None)]
    claims = [[v.claim.knob, v.claim.change, v.claim.claimed, f"`{v.claim.baseline}` → `{v.claim.tuned}`",
               f"{v.speedup:.3f}× ({_ci(v.speedup_ci95)})", v.memory_text, v.verdict, v.memory_verdict or "–"]
              for v in verdicts]
    configs = [[f"`{r.config}`", r.implementation, ", ".join(f"{k}={v}" for k, v in r.options.items()) or "defaults",
                r.precision, fmt.ms(r.median_step_s),
                fmt.mb(max(r.peak_memory_bytes)) if r.peak_memory_bytes else "–"] for r in records]
    ours = next((v for v in verdicts if v.claim.baseline == "torch" and v.claim.tuned == "ours"), None)
    ours_ratio = None
    if ours is not None:
        ci = ours.speedup_ci95
        ours_ratio = dict(median=1 / ours.speedup, ci=None if ci is None else (1 / ci[1], 1 / ci[0]), verdict=ours.verdict)
    bn = results.notes.get("batchnorm")
    peaks = {r.config: r.peak_memory_bytes for r in records if r.peak_memory_bytes}
    rising = sorted(c for c, p in peaks.items() if len(set(p)) > 1)
    n_parameters = results.notes.get("n_parameters") or 0
    views = {}
    if per_process and "torch" in peaks and "torch+views" in peaks:
        base, tuned = max(peaks["torch"]), max(peaks["torch+views"])
        views = dict(views_saved=base - tuned, grad_copy=FLOAT32_BYTES * n_parameters, views_share=1 - tuned / base)
    return dict(
        **views, loaded=loaded, per_process=per_process, rising=rising, shared_gpu=results.environment.shared_gpu,
        memory_rounds={c: [fmt.mb(b) for b in p] for c, p in peaks.items()},
        heading=fmt.run_heading(machine, results), env=results.environment,
        setting=fmt.workload_setting_line(results, f"{results.setting.get('rounds', '?')} interleaved rounds of "
                                          f"{len(records)} configurations, a fresh Trainer each"
                                          f"{' in processes of its own' if per_process else ''}, "
                                          f"{results.setting.get('steps_per_round', '?')} timed step(s) after "
                                          f"{results.setting.get('warmup_steps', '?')} untimed"),
        n_parameters=results.notes.get("n_parameters"), claims=fmt.table(
            ["knob", "change", "claimed", "configurations", "measured speed-up (95% interval)", "memory saving",
             "verdict (speed)", "verdict (memory)"], claims),
        configs=fmt.table(["configuration", "implementation", "options", "precision", "median step (ms)",
                           "peak memory (MB)"], configs),
        verdicts=verdicts, ours=ours_ratio, batchnorm=bn, batchnorm_verdict=batchnorm_verdict(bn),
        has_memory=any(r.peak_memory_bytes for r in records))


def lightning_claims_page(ctx: RenderContext) -> Page:
    runs = [_run(m, f) for m, f in ctx.inputs.runs(KIND) if f.records]
    one_gpu = " ".join(shlex.quote(a) for a in claims_gpu_args(1))
    two_gpu = " ".join(shlex.quote(a) for a in claims_gpu_args(2))
    markdown = templating.render(
        "details/lightning_claims.md.j2", runs=runs, n_configs=len(CONFIGS), tolerance=BATCHNORM_TOLERANCE,
        gpu_command=f"python {SCRIPT} {one_gpu}", nccl_command=f"python {SCRIPT} {two_gpu}",
        verdict_names=dict(holds=HOLDS, fails=FAILS, unresolved=UNRESOLVED, not_evidence=NOT_EVIDENCE, outside=OUTSIDE),
        cpu_command="make bench", gpu_runs=[dict(source=f.source, rounds=f.setting.get("rounds") or 0,
                                                  model=f.setting.get("model_size"), ranks=f.environment.world_size)
                                             for _, f in ctx.inputs.runs(KIND) if f.environment.device_type == "cuda"])
    return Page("lightning_claims", markdown)
