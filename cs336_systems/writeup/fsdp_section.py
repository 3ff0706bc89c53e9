"""FSDP: how it works, and DDP, ZeRO-1, our FSDP and torch's FSDP measured side by side.

Reads ``fsdp_step.json`` (:class:`~cs336_systems.bench.fsdp.record.FsdpStepRecord`, one per
configuration). Step-time differences are stated only with their paired 95% interval, and
"indistinguishable here" when it holds zero; memory and bytes are exact counts of one step.
The timeline is drawn from the intervals the run recorded (fsdp_figure.py).
"""

from __future__ import annotations

from pathlib import Path

from cs336_systems.bench.fsdp.formulas import DDP, FSDP, TORCH_FSDP, ZERO1
from cs336_systems.bench.fsdp.record import ALL_GATHER, COLLECTIVES, REDUCE_SCATTER, FsdpStepRecord, FsdpTimeline
from cs336_systems.bench.profile.timeline import merge_intervals, total_length
from cs336_systems.writeup import fmt
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import not_measured_notes
from cs336_systems.writeup.fsdp_figure import render_fsdp_timelines
from cs336_systems.writeup.load import MachineResults, ResultsFile
from cs336_systems.writeup.paired import INDISTINGUISHABLE, Paired, difference_clause, signed_ms

KIND = FsdpStepRecord.KIND
NAMES = {DDP: "DDP", ZERO1: "ZeRO-1", FSDP: "our FSDP", TORCH_FSDP: "torch's FSDP"}
COMMAND = "python scripts/bench_fsdp.py --model-size cpu-small --world-size 2 --rounds 6"

HOW = """\
FSDP (fully sharded data parallelism; stage 3 of ZeRO, Rajbhandari et al., 2020) shards what DDP
replicates. Every rank keeps 1/n of each Linear and Embedding weight (flattened, padded to a multiple
of n, one slice per rank), and AdamW steps on that slice only, so parameters, gradients and optimizer
state all shrink n-fold; the few small parameters (norm gains) stay replicated and their gradients
are all-reduced. A layer's full weight exists only while the layer computes. In forward, just before
a layer runs, its weight is all-gathered (or its prefetched gather waited for) and the gather of the
next layer's weight is launched, so it travels while this layer computes; after the layer, the full
weight is freed. In backward, each layer's weight is gathered again when autograd needs it (again
with the next one prefetched), its gradient is computed, reduce-scattered asynchronously (each rank
receives the sum for its own slice, divided by n) while backward goes on with the layers below, and
the full weight and gradient are freed. After backward the rank waits for the last reductions and
steps. Per step each weight's bytes cross the network three times (gather, gather, reduce-scatter),
against DDP's all-reduce, which costs two: FSDP trades 1.5 times DDP's traffic for memory
(`cs336_systems/fsdp/`; our unit of gathering is one layer's weight, torch's one `fully_shard` module,
here a Transformer block)."""

EXACT = """\
**Two modes.** `adapters.get_fsdp` builds our FSDP in its default reduce-scatter mode, the one timed
here: each rank backpropagates only its own rows and each weight gradient is reduce-scattered to the
shards. It equals single-process training within float32 rounding, not bitwise: a float32 matmul over
the whole batch sums its rows in one chain, while the ranks sum their halves and the reduce-scatter
adds the halves, which rounds differently in the last bits (torch's `fully_shard` alike). The public
2026.1.2 and 2026.1.4 tests compare with a tolerance and pass; 26.1.1's `torch.equal` in float32 holds
for no reduce-scatter FSDP. `FullyShardedDataParallel(..., exact_gradients=True)` makes it hold: for
each layer in backward it all-gathers the layer's input and output gradient and recomputes the
parameter gradients of the whole global batch, the single process's arithmetic, at the cost of the
all-gathered activations and every rank computing the weight gradients of the whole batch
(`cs336_systems/fsdp/exact.py`); no adapter uses it by default."""


PICK = """\
**When to pick which.** DDP holds the whole model, its gradients and AdamW's two moments on every rank
(16 bytes per parameter in float32) and moves the least per step: pick it while that fits with room
for activations. ZeRO-1 keeps the same compute and gradients but shards the optimizer state (4 + 4 +
8/n bytes per parameter), paying a broadcast of the updated parameters, 1.5 times DDP's traffic: pick
it when the optimizer state is what does not fit. FSDP shards everything (16/n bytes per parameter,
plus two layers' full weights and gradients in flight) at the same 1.5 times DDP's traffic and many
more, smaller collectives whose latency the prefetch must hide: pick it when even parameters and
gradients do not fit, or to train the largest model the machine holds."""


def _overlap(a: list[list[float]], b: list[list[float]]) -> float:
    """Length of the intersection of two sets of intervals."""
    b_merged = merge_intervals(map(tuple, b))
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in merge_intervals(map(tuple, a))
               for s2, e2 in b_merged)


def _timeline_sentence(name: str, t: FsdpTimeline) -> str:
    gathers, reductions = t.collectives.get(ALL_GATHER, []), t.collectives.get(REDUCE_SCATTER, [])
    backward = t.phases.get("backward", [0.0, 0.0])
    parts = [f"the rank waited for communication {fmt.ms(total_length(map(tuple, t.waits)))} ms of the "
             f"{fmt.ms(t.duration_s)} ms step"]
    if gathers:
        open_s = total_length(map(tuple, gathers))
        parts.append(f"it computed during {fmt.pct(_overlap(gathers, t.compute) / open_s if open_s else 0.0)} "
                     f"of the time an all-gather was open ({len(gathers)} all-gathers)")
    if reductions:
        inside = sum(1 for launched, _ in reductions if backward[0] <= launched <= backward[1])
        parts.append(f"{inside} of {len(reductions)} reduce-scatters were launched while backward was still running")
    return f"In {name}'s traced step, " + "; ".join(parts) + "."


def _setting_line(results: ResultsFile) -> str:
    setting = results.setting
    return fmt.workload_setting_line(
        results, f"{setting.get('rounds', '?')} rounds of {setting.get('steps_per_round', '?')} step(s)")


def _paired(r: FsdpStepRecord) -> Paired | None:
    if r.vs_fsdp_s is None:
        return None
    interval = tuple(r.vs_fsdp_ci95_s) if r.vs_fsdp_ci95_s else None
    return Paired(NAMES[r.configuration], NAMES[FSDP], r.vs_fsdp_s, interval, len(r.step_times_s))


def _time_table(records: list[FsdpStepRecord]) -> str:
    rows = []
    for r in records:
        d = _paired(r)
        rows.append([NAMES.get(r.configuration, r.configuration), r.description, fmt.ms(r.median_step_s),
                     f"{fmt.ms(r.min_step_s)}–{fmt.ms(r.max_step_s)}",
                     "–" if d is None else signed_ms(d.median_s), "–" if d is None else fmt.ms_interval(d.interval_s),
                     "–" if d is None else d.reading, fmt.sig(r.tokens_per_s)])
    return fmt.table(["configuration", "what", "median step (ms)", "min–max (ms)", "− our FSDP per round (ms)",
                      "95% interval (ms)", "reading", "tokens/s"], rows, align="llrrrrlr")


def _memory_table(records: list[FsdpStepRecord]) -> str:
    rows = [[NAMES.get(r.configuration, r.configuration), fmt.mb(r.peak_bytes),
             *(fmt.mb(v) for v in r.peak_parts.values()), fmt.mb(r.resident_bytes), fmt.sig(r.bytes_per_parameter),
             f"{fmt.sig(r.largest_parameters / 1e6)} M ({r.largest_model_size or 'none of the table'})"]
            for r in records]
    return fmt.table(["configuration", "peak per rank (MB)", "parameters", "gradients", "optimizer state",
                      "activations", "between steps (MB)", "bytes / parameter", "largest model it fits"], rows)


def _communication_table(records: list[FsdpStepRecord]) -> str:
    ddp = next((r for r in records if r.configuration == DDP), None)
    rows = []
    for r in records:
        cells = [f"{fmt.mb(r.payload_bytes[k])} ({r.calls.get(k, 0)})" if k in r.payload_bytes else "–"
                 for k in COLLECTIVES]
        rows.append([NAMES.get(r.configuration, r.configuration), *cells, fmt.mb(r.traffic_bytes),
                     fmt.mb(r.formula_traffic_bytes), fmt.ratio(r.traffic_bytes / r.formula_traffic_bytes),
                     fmt.ratio(r.traffic_bytes / ddp.traffic_bytes) if ddp else "–"])
    return fmt.table(["configuration", "all-gather MB (calls)", "reduce-scatter MB (calls)", "all-reduce MB (calls)",
                      "broadcast MB (calls)", "sent per rank (MB)", "formula (MB)", "measured / formula",
                      "traffic / DDP's"], rows)


def _goal_sentences(by_name: dict[str, FsdpStepRecord]) -> list[str]:
    ours, theirs = by_name.get(FSDP), by_name.get(TORCH_FSDP)
    if ours is None or theirs is None:
        return []
    d = _paired(theirs)
    if d.resolved and d.median_s > 0:
        time_verdict = "met for step time"
    elif d.reading == INDISTINGUISHABLE:
        time_verdict = "met for step time only in the sense that the two are indistinguishable here"
    elif d.resolved:
        time_verdict = (f"**not met for step time**: ours is {fmt.ms(-d.median_s)} ms per step slower "
                        f"(95% interval {fmt.ms_interval((-d.interval_s[1], -d.interval_s[0]))} ms)")
    else:
        time_verdict = "undecided for step time (too few rounds for an interval)"
    change = (theirs.peak_bytes - ours.peak_bytes) / theirs.peak_bytes
    memory_verdict = "met" if ours.peak_bytes <= theirs.peak_bytes else "**not met**"
    return [f"Goal: our FSDP's step time and peak memory per rank at or below torch's on the same model and "
            f"setting. Step time: {difference_clause(d)}; the goal is {time_verdict}. Peak memory per rank: "
            f"{fmt.mb(ours.peak_bytes)} MB ours against {fmt.mb(theirs.peak_bytes)} MB torch's "
            f"({fmt.pct(abs(change))} {'lower' if change >= 0 else 'higher'}); the goal is {memory_verdict} for "
            "memory (one counted step each: exact byte counts, no interval needed)."]


def _run_part(ctx: RenderContext, machine: MachineResults, results: ResultsFile) -> tuple[list[str], list[Path]]:
    records: list[FsdpStepRecord] = results.records
    by_name = {r.configuration: r for r in records}
    world = results.environment.world_size
    mode = by_name[FSDP].fsdp_mode if FSDP in by_name else None
    timed = f"Our FSDP timed in its {mode} mode. " if mode else ""
    out = ["", fmt.run_heading(machine, results), "", _setting_line(results), "",
           f"{timed}Step time (slowest rank per step; differences paired round by round with our FSDP's step):", "",
           _time_table(records), "", *_goal_sentences(by_name), "",
           "Memory per rank over one counted step (the fullest rank), split at the moment of the peak: parameters "
           "(resident shards, buffers and gathered weights), gradients (`.grad`, DDP's buckets, full gradients "
           "awaiting reduction), optimizer state, and activations (everything else: activations, tensors autograd "
           "saved, temporaries). Bytes per parameter = (parameters + gradients + optimizer state) / parameters; "
           "the largest model = (memory free per rank − activations) / bytes per parameter, with memory free "
           f"{fmt.mb(records[0].free_bytes_per_rank)} MB per rank at the start of the run (computed, not trained; "
           "activations held at this model's, so an upper bound).", "", _memory_table(records), "",
           f"Bytes per step and rank (payloads: the full buffers; sent per rank: (n−1)/n of an all-gather's or "
           f"reduce-scatter's payload, 2(n−1)/n of an all-reduce's, (n−1)/n of a broadcast's received, n = {world}; "
           "formula: 2(n−1)/n B for DDP, 3(n−1)/n B for ZeRO-1 and FSDP, B the parameter bytes):", "",
           _communication_table(records)]
    traced = [(NAMES[n], by_name[n].timeline) for n in (FSDP, TORCH_FSDP) if n in by_name and by_name[n].timeline]
    figures = []
    if traced:
        path = render_fsdp_timelines(traced, ctx.figure_path(f"{machine.tag}_{results.name}_timeline.png"))
        figures.append(path)
        out += ["", "One traced step of rank 0 (a dispatch mode notes every operation and collective, which slows "
                "the step; the titles give the traced and the median timed step):", "",
                ctx.image(path, f"FSDP timelines on {machine.tag}"), "",
                " ".join(_timeline_sentence(name, t) for name, t in traced)]
    return out, figures


def fsdp_section(ctx: RenderContext) -> Section:
    out = ["## fsdp_accounting: fully sharded data parallelism (problem fsdp), its memory and its timeline", "",
           HOW, "", EXACT]
    figures: list[Path] = []
    runs = ctx.inputs.runs(KIND)
    for machine, results in runs:
        lines, drawn = _run_part(ctx, machine, results)
        out += lines
        figures += drawn
    missing = not_measured_notes(ctx.inputs, KIND, "FSDP step benchmark")
    if missing:
        out += ["", missing, f"  (One run by hand: `{COMMAND}`.)"]
    out += ["", PICK]
    return Section("\n".join(out), figures)
