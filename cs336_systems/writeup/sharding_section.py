"""Problem optimizer_state_sharding_accounting: memory, step time and bytes moved with and without ZeRO-1.

Reads ``sharded_optimizer.json`` (:class:`~cs336_systems.bench.accounting.AccountingRecord`, one
per configuration and rank). Memory figures are single readings per rank (exact byte counts,
or RSS); time differences are stated only with their paired 95% interval, and "indistinguishable
here" when it holds zero.
"""

from __future__ import annotations

from cs336_systems.bench.accounting.counting import communication_bytes_per_rank
from cs336_systems.bench.accounting.record import (
    CONFIGURATIONS,
    PHASES,
    SHARDED,
    UNSHARDED,
    AccountingRecord,
    sharded_minus_unsharded,
)
from cs336_systems.comm.coalesced import DEFAULT_CHUNK_BYTES
from cs336_systems.writeup import fmt
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import not_measured_notes
from cs336_systems.writeup.load import ResultsFile

KIND = AccountingRecord.KIND
PHASE_WORDS = {
    "after_model": "after the model is built",
    "after_init": "after initialisation (DDP wrapper and optimizer built)",
    "before_step": "directly before `optimizer.step()`",
    "after_step": "directly after it",
}
METHOD_WORDS = {
    "rss": "process RSS high-water mark (VmHWM, reset at each point)",
    "cuda_allocator": "CUDA allocator peak (`torch.cuda.max_memory_allocated`, reset at each point)",
}
ZERO_CITATION = ("Rajbhandari et al., *ZeRO: Memory Optimizations Toward Training Trillion Parameter Models*, "
                 "SC 2020, Sec. 7.2.1")
INTRO = (
    "The same data-parallel training steps (naive DDP, which keeps no gradient copies) with `torch.optim.AdamW` on "
    "every rank (*unsharded*) and with our `ShardedOptimizer` over AdamW (*sharded*: each rank keeps the state of "
    "the parameters it owns and broadcasts them after updating; `cs336_systems/zero/`), in one process group "
    "(`scripts/bench_sharded_optimizer.py`, `cs336_systems/bench/accounting/`). Memory is read for one configuration "
    "at a time, on a fresh model: the baseline before the model is built, then the peak since the previous point and "
    "the level at four points: after the model is built, after initialisation, directly before the optimizer step and "
    "directly after it (on the last of the warm-up steps plus one). Before any baseline, one throwaway step of each "
    "configuration pays the first use of every kernel and collective; the baseline also counts the tensors Python "
    "can still reach, which is 0 when nothing of that step survived. Step times come afterwards from interleaved "
    "rounds: one model, both optimizers over its parameters, one step of each per round in alternating order, so "
    "that the two steps of a round ran seconds apart under the same machine load; each time is the slowest rank's."
)


def _ordered(records: list[AccountingRecord]) -> list[AccountingRecord]:
    order = {c: i for i, c in enumerate(CONFIGURATIONS)}
    return sorted(records, key=lambda r: (order.get(r.configuration, len(order)), r.configuration, r.rank))


def _of(records: list[AccountingRecord], configuration: str) -> list[AccountingRecord]:
    return [r for r in records if r.configuration == configuration]


def _peak_table(records: list[AccountingRecord]) -> str:
    rows = [[r.configuration, r.rank, fmt.mb(r.baseline_bytes),
             *(fmt.mb(r.phase(p).peak_above_baseline_bytes) for p in PHASES)] for r in records]
    return fmt.table(["configuration", "rank", "baseline (MB)", *(f"peak {PHASE_WORDS[p]} (MB)" for p in PHASES)],
                     rows, align="lrrrrrr")


def _breakdown_table(records: list[AccountingRecord]) -> str:
    rows = []
    for r in records:
        for p in PHASES:
            m = r.phase(p)
            rows.append([r.configuration, r.rank, p, fmt.mb(m.parameters_bytes), fmt.mb(m.gradients_bytes),
                         fmt.mb(m.optimizer_state_bytes), fmt.mb(m.other_bytes), fmt.mb(m.peak_above_baseline_bytes),
                         fmt.mb(m.current_above_baseline_bytes)])
    return fmt.table(["configuration", "rank", "point", "parameters (MB)", "gradients (MB)", "optimizer state (MB)",
                      "other (MB)", "peak above baseline (MB)", "level above baseline (MB)"], rows, align="lrlrrrrrr")


def _baseline_sentence(records: list[AccountingRecord]) -> str:
    baselines = [r.baseline_bytes for r in records]
    live = sorted({r.baseline_live_tensor_bytes for r in records})
    spread = max(baselines) - min(baselines)
    text = (f"Baselines, read before each configuration's model is built: {fmt.mb(min(baselines))} to "
            f"{fmt.mb(max(baselines))} MB over configurations and ranks (a spread of {fmt.mb(spread)} MB, against "
            f"{fmt.mb(records[0].parameter_bytes)} MB of parameters). ")
    if live == [0]:
        return text + "No tensor was reachable from Python at any baseline: nothing of the throwaway step survived."
    return text + (f"**Tensors were still reachable at a baseline** ({', '.join(fmt.mb(b) for b in live)} MB): "
                   "something of the throwaway step survived, and the levels above are understated by it.")


def _init_sentence(records: list[AccountingRecord]) -> str:
    r = max(records, key=lambda r: r.after_init.peak_above_baseline_bytes)
    b, init, model = r.parameter_bytes, r.after_init, r.after_model
    one_chunk = min(b, DEFAULT_CHUNK_BYTES)
    if r.method == "rss":
        higher = "higher" if model.other_bytes > init.other_bytes else "lower"
        building = (f"Building the model, before that, peaked {higher}: {fmt.mb(model.other_bytes)} MB above its "
                    "parameters, because torch's `trunc_normal_` samples each weight by rejection through "
                    "temporaries a few times that weight's size (the largest weight here: "
                    f"{fmt.mb(r.largest_parameter_bytes)} MB).")
    else:
        building = (f"Building the model held {fmt.mb(model.other_bytes)} MB on the GPU beyond its parameters: it is "
                    "initialised on the CPU and then copied, so the initialisation's temporaries never reach the GPU.")
    return (
        f"Why the peak after initialisation is {fmt.ratio(init.peak_above_baseline_bytes / b)} the parameters "
        f"({fmt.mb(init.peak_above_baseline_bytes)} MB against {fmt.mb(b)} MB; {r.configuration}, rank {r.rank}): "
        f"besides the parameters it holds {fmt.mb(init.other_bytes)} MB of transients. The DDP wrapper broadcasts "
        "rank 0's parameters and buffers when it is built, packed into flat buffers of at most "
        f"{fmt.mb(DEFAULT_CHUNK_BYTES)} MB (`cs336_systems/comm/coalesced.py`), built and freed one at a time, so up "
        f"to min(B, {fmt.mb(DEFAULT_CHUNK_BYTES)} MB) = {fmt.mb(one_chunk)} MB exists beside the parameters at once. "
        "The optimizer adds nothing yet (AdamW creates its state at the first step). "
        + building
    )


def _memory_sentences(records: list[AccountingRecord], world_size: int) -> list[str]:
    unsharded, sharded = _of(records, UNSHARDED), _of(records, SHARDED)
    if not unsharded or not sharded:
        return [f"This run lacks the {SHARDED if unsharded else UNSHARDED} configuration: nothing to compare."]
    u_state = max(r.optimizer_state_bytes for r in unsharded)
    s_state = max(r.optimizer_state_bytes for r in sharded)
    out = [f"Optimizer state on the fullest rank: {fmt.mb(s_state)} MB sharded against {fmt.mb(u_state)} MB "
           f"unsharded, {fmt.ratio(s_state / u_state)} (1/n = {fmt.sig(1 / world_size)} on {world_size} ranks; the "
           "shards are whole parameters, so a rank can hold more than 1/n)."]
    # Up to initialisation both configurations hold the same tensors: their peaks there differ only
    # by the meter's noise, which is what a difference after the step must be judged against.
    noise = max(abs(u.phase(p).peak_above_baseline_bytes - s.phase(p).peak_above_baseline_bytes)
                for p in ("after_model", "after_init") for u, s in zip(unsharded, sharded))
    out.append(f"Up to initialisation the two configurations hold the same tensors (AdamW creates its state at the "
               f"first step): their peaks there differ by at most {fmt.mb(noise)} MB rank for rank, the noise of "
               "this meter here.")
    for p in ("before_step", "after_step"):
        up = max(r.phase(p).peak_above_baseline_bytes for r in unsharded)
        sp = max(r.phase(p).peak_above_baseline_bytes for r in sharded)
        change = "lower" if sp < up else "higher" if sp > up else "the same"
        out.append(f"Peak {PHASE_WORDS[p]}, largest over ranks: {fmt.mb(sp)} MB sharded, {fmt.mb(up)} MB unsharded "
                   f"({fmt.mb(abs(up - sp))} MB {change} with sharding, against {fmt.mb(u_state - s_state)} MB less "
                   "optimizer state on the fullest rank).")
    return out


def _state_table(records: list[AccountingRecord]) -> str:
    rows = [[r.configuration, r.rank, f"{r.owned_parameters} of {r.n_parameter_tensors}",
             fmt.mb(r.optimizer_state_bytes), fmt.mb(r.expected_optimizer_state_bytes),
             fmt.ratio(r.optimizer_state_bytes / r.expected_optimizer_state_bytes),
             fmt.mb(r.optimizer_state_imbalance_bound_bytes) if r.sharded else "–"] for r in records]
    return fmt.table(["configuration", "rank", "parameter tensors owned", "optimizer state measured (MB)",
                      "expected 2B/n (MB)", "measured / expected", "bound on a shard's excess (MB)"], rows,
                     align="lrrrrrr")


def _difference(label: str, found: tuple[float, tuple[float, float] | None], rounds: int) -> str:
    median, interval = found
    if interval is None:
        return (f"{label}: {fmt.ms(median)} ms over {rounds} rounds, too few for a 95% interval (6 needed): no "
                "difference is stated")
    low, high = interval
    if low <= 0 <= high:
        verdict = "indistinguishable here"
    else:
        verdict = f"sharded {'slower' if median > 0 else 'faster'}"
    return f"{label}: {fmt.ms(median)} ms (95% interval {fmt.ms_interval(interval)} ms): {verdict}"


def _time_part(records: list[AccountingRecord]) -> list[str]:
    firsts: dict[str, AccountingRecord] = {}
    for r in records:
        firsts.setdefault(r.configuration, r)  # every rank holds the same slowest-rank times
    rows = [[c, len(r.step_times_s), fmt.ms(r.median_step_s),
             f"{fmt.ms(min(r.step_times_s))}–{fmt.ms(max(r.step_times_s))}", fmt.ms(r.median_optimizer_step_s)]
            for c, r in firsts.items()]
    out = [fmt.table(["configuration", "rounds timed", "median step (ms)", "min–max (ms)",
                      "median `optimizer.step()` (ms)"], rows)]
    step = sharded_minus_unsharded(records, "step_times_s")
    if step is not None:
        rounds = len(firsts[SHARDED].step_times_s)
        optimizer = sharded_minus_unsharded(records, "optimizer_step_times_s")
        out += ["", "Sharded minus unsharded, round by round (median of the per-round differences):", "",
                f"- {_difference('whole step', step, rounds)};",
                f"- {_difference('`optimizer.step()`', optimizer, rounds)}.", "",
                "The sharded `optimizer.step()` updates only this rank's parameters, then broadcasts every shard from "
                "its owner, so it trades the update of (n−1)/n of the parameters for receiving them."]
    return out


def _communication_part(records: list[AccountingRecord], world_size: int) -> list[str]:
    b = records[0].parameter_bytes
    n = world_size
    comm = communication_bytes_per_rank(b, n)

    def relative(volume: float) -> str:
        return fmt.ratio(volume / comm.ddp_allreduce) if comm.ddp_allreduce else "–"

    rows = [["DDP (gradient all-reduce)", "2(n−1)/n · B", fmt.mb(comm.ddp_allreduce), relative(comm.ddp_allreduce)],
            ["this repo: DDP + sharded optimizer's parameter broadcasts", "2(n−1)/n · B + (n−1)/n · B",
             fmt.mb(comm.ddp_plus_sharded_optimizer), relative(comm.ddp_plus_sharded_optimizer)],
            ["ZeRO stage 1 as in the paper: reduce-scatter gradients, all-gather parameters",
             "(n−1)/n · B + (n−1)/n · B", fmt.mb(comm.paper_zero1), relative(comm.paper_zero1)]]
    text = ("This repo's `ShardedOptimizer` keeps DDP's all-reduce (every rank gets every averaged gradient) and "
            "then broadcasts each updated parameter from its owner: (n−1)/n · B more, 1.5× DDP's volume. The ZeRO "
            "paper's stage 1 reduce-scatters the gradients instead, so each rank receives only the averaged "
            "gradients of the parameters it owns, and all-gathers the updated parameters: the same 2(n−1)/n · B as "
            f"DDP ({ZERO_CITATION}).")
    received = ", ".join(f"rank {r.rank} {fmt.mb(r.broadcast_received_bytes)} MB" for r in _of(records, SHARDED))
    if received:
        text += (f" Exactly, each rank receives the parameters it does not own: {received} (against the formula's "
                 f"{fmt.mb(comm.sharded_optimizer_broadcast)} MB; shards are whole parameters).")
    return [f"Bytes each rank sends (and receives) per step, by the ring formulas, for B = {fmt.mb(b)} MB of "
            f"parameters (float32) and n = {n} ranks:", "",
            fmt.table(["scheme", "formula", "bytes per rank per step (MB)", "relative to DDP"], rows, align="llrr"),
            "", text]


def _setting_line(results: ResultsFile, records: list[AccountingRecord]) -> str:
    s, env = results.setting, results.environment
    parts = [f"backend {env.backend}", f"world size {env.world_size}",
             f"model {s.get('model_size', '?')} ({fmt.sig(records[0].n_parameters / 1e6)}M parameters)",
             f"global batch {s.get('global_batch', '?')} × context {s.get('context_length', '?')}",
             f"AdamW (lr {s.get('lr', '?')}), {s.get('warmup_steps', '?')} warm-up and {s.get('steps', '?')} timed "
             "rounds", f"broadcast buckets of {s.get('bucket_size_mb', '?')} MB"]
    return fmt.setting_line(env, results.source, parts=parts)


def sharding_accounting_section(ctx: RenderContext) -> Section:
    out = ["## optimizer_state_sharding_accounting: memory and time with and without optimizer state sharding", "",
           INTRO]
    for machine, results in ctx.inputs.runs(KIND):
        records = _ordered(results.records)
        world_size = results.environment.world_size
        methods = sorted({r.method for r in records})
        method_text = "; ".join(f"{METHOD_WORDS.get(m, 'an unknown method')} (method `{m}`)" for m in methods)
        out += ["", fmt.run_heading(machine, results), "", _setting_line(results, records), "",
                f"Memory: {method_text}, above the baseline.", "", _baseline_sentence(records), "",
                "#### Peak memory at each point", "", _peak_table(records), "",
                "What each peak holds (tensor bytes counted storage by storage; *other* is the rest of the peak: "
                "activations, temporaries, communication buffers, allocator slack):", "", _breakdown_table(records), "",
                _init_sentence(records), "", "\n".join(f"- {s}" for s in _memory_sentences(records, world_size)), "",
                "#### Optimizer state per rank", "",
                "Expected: AdamW's two float32 moments, 2B for B parameter bytes, or 2B/n per rank when sharded; the "
                "measured figure adds a scalar `step` per parameter, and a shard may exceed the average by at most "
                "the moments of the largest parameter (the bound column).", "", _state_table(records), "",
                "#### Step time", "", *_time_part(records), "",
                "#### Communication per step", "", *_communication_part(records, world_size)]
    notes = not_measured_notes(ctx.inputs, KIND, "Optimizer state sharding accounting")
    if notes:
        out += ["", "### Not measured here", "", notes]
    return Section("\n".join(out))
