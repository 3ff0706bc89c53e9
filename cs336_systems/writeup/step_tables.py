"""How a DDP step run is shown: its setting, its label, the variant table and its columns, the section frame.

Shared by the problem sections (ddp_sections.py), the overhead model and the lever ablation.
A run at world size 1 (the one-GPU NCCL rehearsal, ``ddp_step-nccl1.json``) communicates
nothing: the frame labels it as each wrapper's own cost and compares its variants with the
compute-only step only.
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
from cs336_systems.writeup.paired import paired, paired_table
from cs336_systems.writeup.step_setting import setting_paragraph, short_setting

REHEARSAL_RUN = f"{STEP_KIND}-nccl1"  # NCCL at world size 1 on one GPU, from `make bench-gpu`
FULL_SETTING_IN = "naive_ddp_benchmarking"  # the first DDP section states each run's setting in full


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
                   "sync after backward (ms)", "sync share (median of per-step ratios)", "exposed overhead (ms)",
                   "its 95% interval (ms)", "tokens/s"]

COLUMNS_TEXT = (
    "Columns: *buckets*: buckets built (torch DDP: after its rebuild); *all-reduce calls / step*: collectives a "
    "wrapper issued per step, median over steps (naive and per-parameter add one for their usage counts; torch DDP: "
    "its bucket count); *median step*: median over the timed steps of the slowest rank's step (forward, backward, "
    "synchronisation, optimizer step); *min–max*: its fastest and slowest timed step, the machine's drift, not an "
    "interval; *sync after backward*: median over steps of the time from backward's end to the end of "
    "`finish_gradient_synchronization` (slowest rank; torch DDP synchronises inside backward); *sync share*: the "
    "median over steps of each step's sync / step ratio, which need not equal the ratio of the two medians; *exposed "
    "overhead*: median over rounds of (the variant's step − the compute-only step of the same round); *its 95% "
    "interval*: the sign-test interval of that median; *tokens/s*: tokens of the global batch / median step."
)


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


def rehearsal_text(results: ResultsFile, shown: Iterable[str] | None) -> str:
    """A run with one rank: the table, and each wrapper's cost as its step minus compute-only's."""
    records = pick(results.records, shown) if shown is not None else results.records
    floor = by_variant(results.records).get(COMPUTE_ONLY)
    text = [variant_table(records)]
    others = [r for r in records if r.variant != COMPUTE_ONLY]
    if floor is not None and others:
        text += ["", "With one rank every all-reduce returns at once, so each difference from the compute-only step is "
                     "the wrapper's own work (hooks, copies into buckets, launches, waits):", "",
                 paired_table(paired(r, floor) for r in others)]
    return "\n".join(text)


def rehearsal_note(ctx: RenderContext) -> str:
    """"not measured here" for the one-GPU rehearsal when no machine has it."""
    found = any(f.name == REHEARSAL_RUN or (f.environment.world_size == 1 and f.environment.backend == "nccl")
                for _, f in step_runs(ctx.inputs))
    if found:
        return ""
    return (f"- NCCL at world size 1 on one GPU (`{REHEARSAL_RUN}.json`: each wrapper's own cost, no communication): "
            "**not measured here**; `make bench-gpu` on a machine with one GPU fills it.")


def ddp_section(ctx: RenderContext, heading: str, intro: str, body: RunBody, tail: Tail | None = None,
                more_notes: str = "", shown: Iterable[str] | None = None, full_setting: bool = False) -> Section:
    """Heading, intro, then for each DDP run its setting and ``body(machine, results)``'s markdown,
    then ``tail()``'s lines, then what was not measured.

    The setting is a paragraph with ``full_setting`` (the first DDP section), else one sentence
    pointing to it. A world-size-1 run gets :func:`rehearsal_text` over the ``shown`` variants
    instead of the body.
    """
    out = [heading, "", intro]
    figures = []
    for machine, results in step_runs(ctx.inputs):
        label = run_label(results)
        if label:
            text, figs = rehearsal_text(results, shown), []
        else:
            text, figs = body(machine, results)
        env, notes = results.environment, results.notes
        stated = (setting_paragraph(results.setting, env, notes) if full_setting
                  else short_setting(results.setting, env, notes, FULL_SETTING_IN))
        out += ["", fmt.run_heading(machine, results), "", ddp_setting_line(results), "", stated, "",
                *([f"**{label}.**", ""] if label else []), text]
        figures += figs
    if tail is not None:
        lines, figs = tail()
        out += lines
        figures += figs
    notes = [n for n in (step_not_measured(ctx), rehearsal_note(ctx), more_notes) if n]
    if notes:
        out += ["", "### Not measured here", "", *notes]
    return Section("\n".join(out), figures)
