"""How a DDP step run is shown: its setting line, its label, the variant table, the section frame.

Shared by the problem sections (ddp_sections.py), the overhead model and the lever ablation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import COMPUTE_ONLY, TORCH_DDP
from cs336_systems.writeup import fmt
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import not_measured_notes
from cs336_systems.writeup.ddp_analysis import STEP_KIND, by_variant, step_runs
from cs336_systems.writeup.load import MachineResults, ResultsFile


def ddp_setting_line(results: ResultsFile) -> str:
    """The setting of one DDP step run: hardware, backend, ranks, model, batch, steps."""
    env, setting = results.environment, results.setting
    model = f"model {setting.get('model_size', '?')}"
    n_params = results.notes.get("n_parameters")
    if n_params:
        model += f" ({fmt.sig(n_params / 1e6)}M parameters)"
    parts = [f"backend {env.backend}", f"world size {env.world_size}", model,
             f"global batch {setting.get('global_batch', '?')} × context {setting.get('context_length', '?')}"]
    rounds, per_round = setting.get("rounds"), setting.get("steps_per_round")
    if rounds and per_round:
        parts.append(f"{rounds * per_round} timed steps per variant in {rounds} interleaved "
                     + ("round" if rounds == 1 else "rounds"))
    return fmt.setting_line(env, results.source, parts=parts)


def run_label(results: ResultsFile) -> str | None:
    """What a run without communication measures (world size 1), said before its tables."""
    env = results.environment
    if env.world_size != 1:
        return None
    backend = "NCCL" if env.backend == "nccl" else env.backend
    return f"{backend}, world size 1: each wrapper's own cost, no communication"


VARIANT_HEADERS = ["variant", "buckets", "all-reduce calls / step", "median step (ms)", "min–max (ms)",
                   "sync after backward (ms)", "sync share of step", "exposed overhead (ms)",
                   "its 95% interval (ms)", "tokens/s"]


def variant_row(r: StepRecord) -> list:
    """Calls, step time and spread, sync phase and its share, exposed overhead, throughput."""
    calls = r.allreduce_calls_per_step
    if r.variant == TORCH_DDP:
        sync_cell = share_cell = "inside backward"
    elif r.variant == COMPUTE_ONLY:
        sync_cell = share_cell = "–"
    else:
        sync_cell, share_cell = fmt.ms(r.median_sync_s), fmt.pct(r.sync_share)
    return [
        r.variant,
        "–" if r.n_buckets is None else r.n_buckets,
        "0" if r.variant == COMPUTE_ONLY else ("–" if calls is None else f"{calls:g}"),
        fmt.ms(r.median_step_s),
        f"{fmt.ms(r.min_step_s)}–{fmt.ms(r.max_step_s)}",
        sync_cell,
        share_cell,
        fmt.ms(r.exposed_overhead_s),
        "–" if r.variant == COMPUTE_ONLY else fmt.ms_interval(r.exposed_overhead_ci95_s),
        fmt.sig(r.tokens_per_s),
    ]


def variant_table(records: Iterable[StepRecord]) -> str:
    return fmt.table(VARIANT_HEADERS, [variant_row(r) for r in records])


def pick(records: list[StepRecord], names: Iterable[str]) -> list[StepRecord]:
    variants = by_variant(records)
    return [variants[n] for n in names if n in variants]


def missing_variants(variants: dict[str, StepRecord], names: Iterable[str]) -> list[str]:
    return [n for n in names if n not in variants]


def missing_text(missing: list[str]) -> str:
    return f"This run has no record of {', '.join(f'`{m}`' for m in missing)}."


def compared(results: ResultsFile, shown: Iterable[str], needed: Iterable[str],
             describe: Callable[[dict[str, StepRecord]], str]) -> str:
    """The table of the ``shown`` variants, then ``describe(variants)``, or which of ``needed`` are missing."""
    variants = by_variant(results.records)
    missing = missing_variants(variants, needed)
    text = missing_text(missing) if missing else describe(variants)
    return f"{variant_table(pick(results.records, shown))}\n\n{text}"


RunBody = Callable[[MachineResults, ResultsFile], tuple[str, list[Path]]]


def step_not_measured(ctx: RenderContext, what: str = "DDP step benchmark") -> str:
    """Notes for the settings no multi-rank DDP step run covers (world size 1 communicates nothing)."""
    runs = [f for _, f in step_runs(ctx.inputs) if f.environment.world_size > 1]
    return not_measured_notes(ctx.inputs, STEP_KIND, what, runs=runs)


Tail = Callable[[], tuple[list[str], list[Path]]]


def ddp_section(ctx: RenderContext, heading: str, intro: str, body: RunBody, tail: Tail | None = None,
                 more_notes: str = "") -> Section:
    """Heading, intro, then for each DDP run its setting and ``body(machine, results)``'s markdown,
    then ``tail()``'s lines, then what was not measured."""
    out = [heading, "", intro]
    figures = []
    for machine, results in step_runs(ctx.inputs):
        text, figs = body(machine, results)
        label = run_label(results)
        out += ["", fmt.run_heading(machine, results), "", ddp_setting_line(results), "",
                *([f"**{label}.**", ""] if label else []), text]
        figures += figs
    if tail is not None:
        lines, figs = tail()
        out += lines
        figures += figs
    notes = [n for n in (step_not_measured(ctx), more_notes) if n]
    if notes:
        out += ["", "### Not measured here", "", *notes]
    return Section("\n".join(out), figures)
