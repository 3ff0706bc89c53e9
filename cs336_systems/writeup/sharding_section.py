"""optimizer_state_sharding_accounting: memory, step time and bytes moved with and without sharding.

Reads ``sharded_optimizer.json`` (one :class:`AccountingRecord` per configuration and rank); time differences
only with their paired 95% interval. Words in ``templates/{answers,details}/optimizer_state_sharding*.md.j2``.
"""

from __future__ import annotations

from cs336_basics.model import EDITION_MODEL_SIZES, expected_parameter_count
from cs336_systems.bench.accounting.counting import communication_bytes_per_rank
from cs336_systems.bench.accounting.record import CONFIGURATIONS, PHASES, SHARDED, UNSHARDED, AccountingRecord
from cs336_systems.bench.accounting.record import sharded_minus_unsharded
from cs336_systems.comm.coalesced import DEFAULT_CHUNK_BYTES
from cs336_systems.writeup import coverage, fmt, templating
from cs336_systems.writeup.context import Page, RenderContext, details_link
from cs336_systems.writeup.load import MachineResults, ResultsFile
from cs336_systems.writeup.paired import Paired
from cs336_systems.writeup.step_setting import HANDOUT_MODEL

KIND = AccountingRecord.KIND
ANSWERED = ("after_init", "before_step", "after_step")  # the points the handout asks about
PARTS = ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "other_bytes")
PART_HEADERS = ["parameters (MB)", "gradients (MB)", "optimizer state (MB)", "other (MB)"]


def _peak(records: list[AccountingRecord], point: str) -> float:
    return max(r.phase(point).peak_above_baseline_bytes for r in records)


def _paired(records: list[AccountingRecord], times: str, unfit: str | None) -> Paired | None:
    found = sharded_minus_unsharded(records, times)
    rounds = len(records[0].step_times_s)
    return None if found is None else Paired(SHARDED, UNSHARDED, found[0], found[1], rounds, unfit=unfit)


def _step_benchmark_naive(machine: MachineResults, results: ResultsFile) -> float | None:
    """The median step of naive DDP in this machine's step benchmark on the same model and batch (the
    same NaiveDDP and AdamW, another run): the answer says why the two differ."""
    return next((r.median_step_s for f in machine.runs("ddp_step", like=results) for r in f.records
                 if r.variant == "naive" and f.environment.world_size == results.environment.world_size), None)


def _run(machine: MachineResults, results: ResultsFile) -> dict:
    order = {c: i for i, c in enumerate(CONFIGURATIONS)}
    records = sorted(results.records, key=lambda r: (order.get(r.configuration, len(order)), r.rank))
    by = {c: [r for r in records if r.configuration == c] for c in CONFIGURATIONS}
    configs = [c for c in CONFIGURATIONS if by[c]]
    n, s, env = results.environment.world_size, results.setting, results.environment
    # The answer's table: the fullest rank's tensors after the step and its peak at each point asked about.
    summary = [[c, *(fmt.mb(max(getattr(r.after_step, k) for r in by[c])) for k in PARTS[:3]),
                *(fmt.mb(_peak(by[c], p)) for p in ANSWERED)] for c in configs]
    ranks = [[r.configuration, r.rank, p, *(fmt.mb(getattr(r.phase(p), k)) for k in PARTS),
              fmt.mb(r.phase(p).peak_above_baseline_bytes), fmt.mb(r.phase(p).current_above_baseline_bytes)]
             for r in records for p in PHASES]
    state = [[r.configuration, r.rank, f"{r.owned_parameters} of {r.n_parameter_tensors}",
              *(fmt.mb(b) for b in (r.optimizer_state_bytes, r.expected_optimizer_state_bytes)),
              fmt.ratio(r.optimizer_state_bytes / r.expected_optimizer_state_bytes),
              fmt.mb(r.optimizer_state_imbalance_bound_bytes) if r.sharded else "–"] for r in records]
    times = [[c, len(by[c][0].step_times_s), fmt.ms(by[c][0].median_step_s),
              f"{fmt.ms(min(by[c][0].step_times_s))}–{fmt.ms(max(by[c][0].step_times_s))}",
              fmt.ms(by[c][0].median_optimizer_step_s)] for c in configs]
    init = max(records, key=lambda r: r.after_init.peak_above_baseline_bytes)
    both = len(configs) == len(CONFIGURATIONS)
    # Up to initialisation both configurations hold the same tensors: how far their peaks differ
    # there is the meter's noise, against which a difference after the step is judged.
    noise = max((abs(u.phase(p).peak_above_baseline_bytes - sh.phase(p).peak_above_baseline_bytes)
                 for p in PHASES[:2] for u, sh in zip(by[UNSHARDED], by[SHARDED])), default=0)
    return dict(
        tag=machine.tag, model=s.get("model_size"), method=records[0].method, n=n, b=records[0].parameter_bytes, psi=records[0].n_parameters,
        setting=fmt.setting_line(env, results.source, parts=[
            f"backend {env.backend}", f"world size {n}",
            f"model {fmt.model_name(s.get('model_size', '?'))} ({fmt.sig(records[0].n_parameters / 1e6)}M parameters)",
            f"global batch {s.get('global_batch', '?')} × context {s.get('context_length', '?')}",
            f"AdamW, {s.get('warmup_steps', '?')} warm-up and {s.get('steps', '?')} timed rounds"]),
        baselines=[r.baseline_bytes for r in records], live=sorted({r.baseline_live_tensor_bytes for r in records}),
        init=init, chunk=DEFAULT_CHUNK_BYTES, both=both, noise=noise,
        state={c: max(r.optimizer_state_bytes for r in by[c]) for c in configs},
        peaks={c: {p: _peak(by[c], p) for p in ANSWERED} for c in configs},
        step=_paired(records, "step_times_s", fmt.not_evidence(env)) if both else None,
        optimizer=_paired(records, "optimizer_step_times_s", fmt.not_evidence(env)) if both else None,
        medians={c: by[c][0].median_step_s for c in configs},
        optimizer_medians={c: by[c][0].median_optimizer_step_s for c in configs},
        naive_elsewhere=_step_benchmark_naive(machine, results), shared_gpu=env.shared_gpu,
        rounds=s.get("steps"), device=env.device_type,
        comm=communication_bytes_per_rank(records[0].parameter_bytes, n),
        received=[(r.rank, r.broadcast_received_bytes) for r in by[SHARDED]],
        summary=fmt.table(["configuration (MB)", *(h.removesuffix(" (MB)") for h in PART_HEADERS[:3]),
                           *(f"peak {p}" for p in ANSWERED)], summary),
        ranks=fmt.table(["configuration", "rank", "point", *PART_HEADERS, "peak (MB)", "level (MB)"], ranks,
                        align="lrlrrrrrr"),
        state_table=fmt.table(["configuration", "rank", "parameter tensors owned", "measured (MB)",
                               "expected 2B/n (MB)", "measured / expected", "bound on a shard's excess (MB)"], state),
        times=fmt.table(["configuration", "rounds", "median step (ms)", "min–max (ms)",
                         "median `optimizer.step()` (ms)"], times))


def sharding_page(ctx: RenderContext) -> Page:
    runs = [_run(machine, results) for machine, results in ctx.inputs.runs(KIND) if results.records]
    missing = [s.name for s in coverage.note_gaps(ctx, KIND, "optimizer state sharding accounting")]
    # One answer per part: the run at the handout's model answers; any other run's answer is on the page.
    main = next((r for r in runs if r["model"] == HANDOUT_MODEL), runs[0]) if runs else None
    kept = dict(missing=missing, gaps=details_link("machines", "not-measured-here"),
                link=details_link("optimizer_state_sharding"))
    rest = [r for r in runs if r is not main]
    # (b) from the main run when it has an interval; else beside it, the first other run that has one.
    evidence = next((r for r in rest if r["step"] and r["step"].interval_s), None)
    xl2026 = dict(psi=expected_parameter_count(EDITION_MODEL_SIZES["2026"][HANDOUT_MODEL]))
    answer = templating.render("answers/optimizer_state_sharding_accounting.md.j2", runs=runs[:1] and [main],
                               others=rest, evidence=evidence, xl2026=xl2026, **kept)
    others = [templating.render("answers/optimizer_state_sharding_accounting.md.j2", runs=[r], missing=[], others=[],
                                evidence=None, xl2026=None,
                                link="optimizer_state_sharding.md", gaps="machines.md#not-measured-here") for r in rest]
    markdown = templating.render("details/optimizer_state_sharding.md.j2", runs=runs, missing=missing,
                                 gaps="machines.md#not-measured-here", others=others)
    return Page("optimizer_state_sharding", markdown, {"optimizer_state_sharding_accounting": answer})
