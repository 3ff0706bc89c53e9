"""Beyond the handout: optimizer state sharding (ZeRO-1) accounted for: memory, step time, bytes moved."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from cs336_systems.bench.stats import paired_median
from cs336_systems.writeup import fmt
from cs336_systems.writeup.ddp_analysis import Record, by_variant
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import not_measured_notes, run_setting
from cs336_systems.writeup.ddp_sections import COMPUTE_ONLY, TORCH_DDP, ddp_setting_line
from cs336_systems.writeup.figures import error_bars, save
from cs336_systems.writeup.load import ResultsFile

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
        out += ["", fmt.run_heading(machine, results), "", _sharding_setting_line(results), "",
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
