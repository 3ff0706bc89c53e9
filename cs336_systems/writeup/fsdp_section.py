"""fsdp_accounting (2026 edition): DDP, the sharded optimizer, our FSDP and torch's FSDP measured side by side.

"ZeRO-1" in the writeup means only the paper's stage 1 (Rajbhandari et al. 2020: mixed precision,
2Ψ + 2Ψ + 12Ψ/N bytes, DP's traffic); this repo's ShardedOptimizer (FP32, 4Ψ + 4Ψ + 8Ψ/N, a
broadcast on top of DP's all-reduce) is "the sharded optimizer".

Reads ``fsdp_step.json`` (one :class:`FsdpStepRecord` per configuration); step-time differences only with
their paired 95% interval. Words in ``templates/answers/fsdp_accounting.md.j2`` and ``templates/details/fsdp.md.j2``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from matplotlib.patches import Patch

from cs336_basics.model import EDITION_MODEL_SIZES, expected_parameter_count
from cs336_systems.bench.allreduce.setting import FLOAT32_BYTES as FP32_BYTES
from cs336_systems.bench.fsdp.configurations import DESCRIPTIONS
from cs336_systems.bench.fsdp.formulas import DDP, FSDP, TORCH_FSDP, ZERO1
from cs336_systems.bench.fsdp.memory import FsdpMemoryRecord
from cs336_systems.bench.fsdp.record import ALL_GATHER, COLLECTIVES, REDUCE_SCATTER, FsdpStepRecord, FsdpTimeline
from cs336_systems.bench.profile.timeline import merge_intervals, total_length
from cs336_systems.capacity.handout import HANDOUT_PRECISION
from cs336_systems.capacity.memory import state_bytes_per_parameter
from cs336_systems.writeup import coverage, fmt, templating
from cs336_systems.writeup.context import Page, RenderContext, details_link
from cs336_systems.writeup.figures import timeline_panels
from cs336_systems.writeup.fsdp_modules_section import modules_runs
from cs336_systems.writeup.fsdp_options_section import options_runs
from cs336_systems.writeup.load import MachineResults, ResultsFile
from cs336_systems.writeup.paired import Paired, signed_ms

KIND = FsdpStepRecord.KIND
HANDOUT_MODEL = "xl"  # the handout's model for fsdp_accounting
EDITION = "2026"  # fsdp_accounting is the 2026 handout's, and so is its xl (not the 2025 one's)
NAMES = {DDP: "DDP", ZERO1: "sharded optimizer", FSDP: "our FSDP", TORCH_FSDP: "torch's FSDP"}


PHASE_COLORS = {"forward": "#9ecae1", "backward": "#a1d99b", "finish": "#fdae6b", "optimizer_step": "#bcbddc"}
COMPUTE_COLOR, WAIT_COLOR = "#31a354", "#fd8d3c"
COLLECTIVE_COLORS = {"all_gather": "#3182bd", "reduce_scatter": "#de2d26", "all_reduce": "#756bb1",
                     "broadcast": "#636363"}
ROW_HEIGHT_IN = 3.0  # inches per timeline
# A wait shorter than this left forward waiting for nothing: the traced Work.wait of an all-gather
# that had already completed returns within microseconds (zero-length intervals in the trace).
WAIT_FLOOR_S = 1e-4


def _bars(intervals: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    """(start, width) in ms, as ``broken_barh`` wants them."""
    return [(a * 1e3, (b - a) * 1e3) for a, b in intervals]


def _draw(ax, title: str, timeline: FsdpTimeline, bottom: bool) -> None:
    kinds = [k for k in COLLECTIVES if timeline.collectives.get(k)]
    lanes = [*(k.replace("_", "-") for k in reversed(kinds)), "waiting", "compute", "phase"]
    for i, kind in enumerate(reversed(kinds)):
        calls = timeline.collectives[kind]
        # Alternate calls between two half-height rows, so that calls in flight together stay apart.
        for parity in (0, 1):
            ax.broken_barh(_bars(calls[parity::2]), (i - 0.35 + 0.36 * (1 - parity), 0.34),
                           facecolor=COLLECTIVE_COLORS[kind], edgecolor="white", linewidth=0.3)
    ax.broken_barh(_bars(timeline.waits), (len(kinds) - 0.35, 0.7), facecolor=WAIT_COLOR)
    compute_lane = len(kinds) + 1
    ax.broken_barh(_bars(timeline.compute), (compute_lane - 0.35, 0.7), facecolor=COMPUTE_COLOR)
    for name, span in timeline.phases.items():
        ax.broken_barh(_bars([span]), (compute_lane + 0.6, 0.8), facecolor=PHASE_COLORS.get(name, "0.8"),
                       edgecolor="0.3", linewidth=0.5)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_title(f"{title}: traced step {timeline.duration_s * 1e3:.0f} ms (median timed step "
                 f"{timeline.timed_median_s * 1e3:.0f} ms)", fontsize=9, loc="left")
    if bottom:
        handles = [Patch(facecolor=c, label=n.replace("_", " ")) for n, c in PHASE_COLORS.items()]
        handles += [Patch(facecolor=COMPUTE_COLOR, label="compute"), Patch(facecolor=WAIT_COLOR, label="waiting")]
        handles += [Patch(facecolor=c, label=k.replace("_", "-")) for k, c in COLLECTIVE_COLORS.items()]
        ax.legend(handles=handles, loc="upper right", bbox_to_anchor=(1.0, -0.25), fontsize=7, ncol=9,
                  frameon=False)
        ax.set_xlabel("time since the step started (ms)", fontsize=8)


def render_fsdp_timelines(timelines: Sequence[tuple[str, FsdpTimeline]], path: Path) -> Path:
    """A PNG with one panel per (title, timeline), top to bottom, on a shared time axis, from one traced step.

    Lanes, top to bottom: phases; compute; waiting (blocked in a collective's ``wait``: communication
    not hidden); one lane per kind of collective, each bar from launch to completion. A collective bar
    beside a compute bar is communication hidden behind computation."""
    return timeline_panels(timelines, _draw, lambda t: t.duration_s * 1e3, path, ROW_HEIGHT_IN)


def _overlap(a: list[list[float]], b: list[list[float]]) -> float:
    """Length of the intersection of two sets of intervals."""
    b = merge_intervals(map(tuple, b))
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in merge_intervals(map(tuple, a)) for s2, e2 in b)


def _timeline(name: str, t: FsdpTimeline) -> dict:
    gathers, reductions = t.collectives.get(ALL_GATHER, []), t.collectives.get(REDUCE_SCATTER, [])
    forward, backward = t.phases.get("forward", [0.0, 0.0]), t.phases.get("backward", [0.0, 0.0])
    # Forward's own all-gathers (launched inside it), apart from the step's: backward gathers again.
    in_forward = [g for g in gathers if forward[0] <= g[0] <= forward[1]]
    # Gather by gather: how long forward waited while each was open (fsdp_accounting (b)).
    waits = [_overlap(t.waits, [g]) for g in in_forward]
    return dict(waited=[(i, w) for i, w in enumerate(waits, start=1) if w > WAIT_FLOOR_S], name=name, step=t.duration_s, timed=t.timed_median_s, wait=total_length(map(tuple, t.waits)),
                forward_gathers=len(in_forward), forward_gather_open=total_length(map(tuple, in_forward)),
                forward_computing=_overlap(in_forward, t.compute),
                forward=forward[1] - forward[0], forward_wait=_overlap(t.waits, [forward]), gathers=len(gathers),
                gather_open=total_length(map(tuple, gathers)), computing=_overlap(gathers, t.compute),
                reductions=len(reductions), in_backward=sum(backward[0] <= s <= backward[1] for s, _ in reductions))


def _against_formula(by: dict[str, FsdpStepRecord], n: int, psi: int) -> dict:
    """Section 6's FP32 accounting against the measured peaks: what FSDP should save against DDP, and
    how far the measured saving is from it (as a whole: the parts of two peaks taken at different
    moments of the step hold different transient tensors, so no part-by-part split is offered)."""
    ordered = [by[c] for c in (DDP, ZERO1, FSDP, TORCH_FSDP) if c in by]
    shard = FP32_BYTES * psi / n
    out = dict(expected_saving=(1 - 1 / n) * 16 * psi, activations=[r.peak_activations_bytes for r in ordered],
               grad_shard=shard, departure=None,
               partial_grads=[fmt.mb(by[c].peak_gradients_bytes) for c in (FSDP, TORCH_FSDP)
                              if c in by and by[c].peak_gradients_bytes < shard])
    if DDP in by and FSDP in by:
        out["departure"] = by[DDP].peak_bytes - by[FSDP].peak_bytes - out["expected_saving"]
    return out


def accounting(psi: float, n: int) -> dict[str, float]:
    """Bytes per rank of each configuration's training state by Section 6's accounting, from the
    capacity library's per-parameter counts (the handout's FP32 weights, gradients and AdamW moments):
    DDP holds all of it, the sharded optimizer divides the moments, FSDP divides everything."""
    p = HANDOUT_PRECISION
    per_parameter = state_bytes_per_parameter(p)  # 16
    moments = p.optimizer_moments * p.optimizer_moment_bytes  # 8
    return {DDP: per_parameter * psi, ZERO1: (per_parameter - moments) * psi + moments * psi / n,
            FSDP: per_parameter * psi / n}


def handout_expectation(n: int) -> dict:
    """fsdp_accounting (a) at the 2026 handout's xl: Ψ from the model's formula, the accounting above."""
    config = EDITION_MODEL_SIZES[EDITION][HANDOUT_MODEL]
    psi = expected_parameter_count(config)
    state = accounting(psi, n)
    return dict(psi=psi, n=n, state=state, saving=state[DDP] - state[FSDP], vs_zero1=state[ZERO1] - state[FSDP],
                edition=EDITION, config=config)


def memory_runs(ctx: RenderContext) -> list[dict]:
    """The per-process peaks (fsdp_memory.json): each configuration's largest rank, beside the accounting."""
    runs = []
    for machine, results in ctx.inputs.runs(FsdpMemoryRecord.KIND):
        by = {r.configuration: r for r in results.records}
        if not {DDP, FSDP} <= set(by) or max(by[DDP].peak_bytes) < 0:
            continue
        psi, n = by[DDP].n_parameters, results.environment.world_size
        held = {c: max(r.held_after_step_bytes) for c, r in by.items()}
        peak = {c: max(r.peak_bytes) for c, r in by.items()}
        state = accounting(psi, n)
        runs.append(dict(tag=machine.tag, source=results.source, model=results.setting.get("model_size"), psi=psi, n=n,
                         setting=fmt.workload_setting_line(results, "each configuration in processes of its own"),
                         held=held, peak=peak, state=state, caveats=fmt.caveats(results), names=[c for c in (DDP, ZERO1, FSDP) if c in by],
                         transient={c: peak[c] - held[c] for c in by}))
    return runs


def _paired(r: FsdpStepRecord, unfit: str | None) -> Paired | None:
    interval = tuple(r.vs_fsdp_ci95_s) if r.vs_fsdp_ci95_s else None
    return None if r.vs_fsdp_s is None else Paired(NAMES[r.configuration], NAMES[FSDP], r.vs_fsdp_s, interval,
                                                   len(r.step_times_s), unfit=unfit)


def _bucketed_elsewhere(machine: MachineResults, results: ResultsFile) -> tuple[float, str, str] | None:
    """The step benchmark's bucketed DDP at 25 MB on the same model and batch (another run), with its
    file and both runs' load, each as its file records it."""
    found = [(r.median_step_s, f.source, f"{fmt.others(f.environment)} there, {fmt.others(results.environment)} here")
             for f in machine.runs("ddp_step", like=results) for r in f.records if r.variant == "bucketed-25MB"]
    return found[0] if found else None


def _run(ctx: RenderContext, machine: MachineResults, results: ResultsFile) -> dict:
    records: list[FsdpStepRecord] = results.records
    by, unfit = {r.configuration: r for r in records}, fmt.not_evidence(results.environment)
    named = [(NAMES.get(r.configuration, r.configuration), r) for r in records]
    # What each configuration is, in the writeup's words (the record's text may predate them).
    times = [[name, DESCRIPTIONS.get(r.configuration, r.description), fmt.ms(r.median_step_s), f"{fmt.ms(r.min_step_s)}–{fmt.ms(r.max_step_s)}",
              *(["–"] * 3 if d is None else [signed_ms(d.median_s), fmt.ms_interval(d.interval_s), d.reading]),
              fmt.sig(r.tokens_per_s)] for name, r in named for d in [_paired(r, unfit)]]
    memory = [[name, fmt.mb(r.peak_bytes), *(fmt.mb(v) for v in r.peak_parts.values()), fmt.mb(r.resident_bytes),
               fmt.sig(r.bytes_per_parameter)] for name, r in named]
    ddp = by.get(DDP)
    comm = [[name, *(f"{fmt.mb(r.payload_bytes[k])} ({r.calls.get(k, 0)})" if k in r.payload_bytes else "–"
                     for k in COLLECTIVES), fmt.mb(r.traffic_bytes), fmt.mb(r.formula_traffic_bytes),
             fmt.ratio(r.traffic_bytes / r.formula_traffic_bytes),
             fmt.ratio(r.traffic_bytes / ddp.traffic_bytes) if ddp else "–"] for name, r in named]
    traced = [(NAMES[c], by[c].timeline) for c in (FSDP, TORCH_FSDP) if c in by and by[c].timeline]
    figure = render_fsdp_timelines(traced, ctx.figure_path(f"{machine.tag}_{results.name}_timeline.png")) \
        if traced else None
    n, psi = results.environment.world_size, records[0].n_parameters
    return dict(
        **_against_formula(by, n, psi),
        tag=machine.tag, n=n, psi=psi, figure=figure, unfit=unfit, bucketed_elsewhere=_bucketed_elsewhere(machine, results),
        setting=fmt.workload_setting_line(results, f"{results.setting.get('rounds', '?')} rounds"),
        mode=by[FSDP].fsdp_mode if FSDP in by else None, peak={c: r.peak_bytes for c, r in by.items()},
        torch=_paired(by[TORCH_FSDP], unfit) if TORCH_FSDP in by and FSDP in by else None,
        timelines=[_timeline(n, t) for n, t in traced],
        image=figure and ctx.image(figure, f"FSDP timelines on {machine.tag}"),
        answer_image=figure and ctx.answer_image(figure, f"FSDP timelines on {machine.tag}"),
        times=fmt.table(["configuration", "what", "median step (ms)", "min–max (ms)", "− our FSDP per round (ms)",
                         "95% interval (ms)", "reading", "tokens/s"], times, align="llrrrrlr"),
        memory=fmt.table(["configuration", "peak per rank (MB)", "parameters", "gradients", "optimizer state",
                          "activations", "between steps (MB)", "bytes / parameter"], memory),
        comm=fmt.table(["configuration", *(f"{k.replace('_', '-')} MB (calls)" for k in COLLECTIVES),
                        "sent per rank (MB)", "formula (MB)", "measured / formula", "traffic / DDP's"], comm))


def fsdp_page(ctx: RenderContext) -> Page:
    runs = [_run(ctx, machine, results) for machine, results in ctx.inputs.runs(KIND) if results.records]
    missing = [s.name for s in coverage.note_gaps(ctx, KIND, "FSDP step benchmark")]
    names = dict(ddp=DDP, zero1=ZERO1, fsdp=FSDP, torch=TORCH_FSDP)
    options = options_runs(ctx)
    memory, handout = memory_runs(ctx), handout_expectation(2)
    answer = templating.render("answers/fsdp_accounting.md.j2", runs=runs, missing=missing, c=names,
                               link=details_link("fsdp"), gaps=details_link("machines", "not-measured-here"),
                               memory=memory, handout=handout, names=NAMES)
    markdown = templating.render("details/fsdp.md.j2", runs=runs, missing=missing, c=names,
                                 gaps="machines.md#not-measured-here", options=options, modules=modules_runs(ctx))
    return Page("fsdp", markdown, {"fsdp_accounting": answer}, [r["figure"] for r in runs if r["figure"]])
