"""Beyond the handout: the tuning guides' DDP claims, measured through Lightning (``lightning_claims.json``).

The run is ``scripts/bench_lightning.py`` (cs336_systems/bench/claims/); the verdicts are the
library's (claims/verdicts.py), so the page and the script's console table agree. Numbers
only; the words are in ``templates/details/lightning_claims.md.j2``.
"""

from __future__ import annotations

import shlex

from cs336_systems.bench.claims.configs import CONFIGS
from cs336_systems.bench.claims.record import ClaimsRecord
from cs336_systems.bench.claims.verdicts import BATCHNORM_TOLERANCE, batchnorm_verdict, judge_all
from cs336_systems.bench.suites import claims_gpu_args
from cs336_systems.ddp.overhead_model import exposed_overhead
from cs336_systems.units import MB
from cs336_systems.writeup import fmt, templating
from cs336_systems.writeup.allreduce_analysis import LinkFit
from cs336_systems.writeup.context import Page, RenderContext
from cs336_systems.writeup.ddp_analysis import run_fit

# The sizes the guide's bucket_cap_mb row names (100M-1B, above 1B), and the caps it compares.
GUIDE_PARAMETERS = (100e6, 1e9, 10e9)
GUIDE_CAPS_MB = (25.0, 50.0, 100.0)
FLOAT32_BYTES = 4

KIND = ClaimsRecord.KIND
SCRIPT = "scripts/bench_lightning.py"


def _ci(interval: tuple[float, float] | None, digits: int = 3) -> str:
    return "too few rounds" if interval is None else f"{interval[0]:.{digits}f}–{interval[1]:.{digits}f}"


def _predicted_caps(fit: LinkFit) -> str:
    """The overhead model's exposed communication per step for the guide's sizes and caps, on this
    machine's all-reduce line (closed form: equal buckets, backward as fast as the channel)."""
    rows = []
    for n in GUIDE_PARAMETERS:
        s = FLOAT32_BYTES * n
        t = {cap: exposed_overhead(s, fit.w_bytes_per_s, fit.o_s, s / (cap * MB)) for cap in GUIDE_CAPS_MB}
        rows.append([f"{n / 1e9:g}B" if n >= 1e9 else f"{n / 1e6:g}M",
                     *(f"{fmt.ms(t[cap])} ({(t[cap] - t[GUIDE_CAPS_MB[0]]) * 1e3:+.1f})" for cap in GUIDE_CAPS_MB)])
    return fmt.table(["parameters", *(f"{cap:g} MB: exposed ms (vs 25 MB)" for cap in GUIDE_CAPS_MB)], rows)


def _run(machine, results) -> dict:
    records: list[ClaimsRecord] = results.records
    verdicts = judge_all(records)
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
    fit = run_fit(machine, results)
    return dict(
        heading=fmt.run_heading(machine, results), env=results.environment,
        setting=fmt.workload_setting_line(results, f"{results.setting.get('rounds', '?')} interleaved rounds of "
                                          f"{len(records)} configurations, a fresh Trainer each, "
                                          f"{results.setting.get('steps_per_round', '?')} timed step(s) after "
                                          f"{results.setting.get('warmup_steps', '?')} untimed"),
        n_parameters=results.notes.get("n_parameters"), claims=fmt.table(
            ["knob", "change", "claimed", "configurations", "measured speed-up (95% interval)", "memory saving",
             "verdict (speed)", "verdict (memory)"], claims),
        configs=fmt.table(["configuration", "implementation", "options", "precision", "median step (ms)",
                           "peak memory (MB)"], configs),
        verdicts=verdicts, ours=ours_ratio, batchnorm=bn, batchnorm_verdict=batchnorm_verdict(bn),
        has_memory=any(r.peak_memory_bytes for r in records),
        fit=fit if isinstance(fit, LinkFit) else None, predicted=_predicted_caps(fit) if isinstance(fit, LinkFit) else None)


def lightning_claims_page(ctx: RenderContext) -> Page:
    runs = [_run(m, f) for m, f in ctx.inputs.runs(KIND) if f.records]
    one_gpu = " ".join(shlex.quote(a) for a in claims_gpu_args(1))
    two_gpu = " ".join(shlex.quote(a) for a in claims_gpu_args(2))
    markdown = templating.render(
        "details/lightning_claims.md.j2", runs=runs, n_configs=len(CONFIGS), tolerance=BATCHNORM_TOLERANCE,
        gpu_command=f"python {SCRIPT} {one_gpu}", nccl_command=f"python {SCRIPT} {two_gpu}",
        cpu_command="make bench")
    return Page("lightning_claims", markdown)
