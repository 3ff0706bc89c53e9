"""The FSDP page's modules table: our ``fully_shard`` beside torch's on the models of
cs336_systems/bench/fsdp/modules.py, one table per run (2 and 3 gloo ranks from ``make bench``).

Reads ``fsdp_modules*.json`` (one :class:`FsdpModuleRecord` per case). Every row is read by the
options table's rule (fsdp_options_section.ratio_reading: "no slower" when the ratio's 95%
interval ends at or below 1, "indistinguishable here" when it holds 1) and its bytes held by the
same 5% (bytes_within). A world size of the issue's (2, 3) with no run is named once as not
measured. Words in ``templates/details/fsdp_modules.md.j2``, included by the FSDP page.
"""

from __future__ import annotations

from cs336_systems.bench.fsdp.modules_run import FsdpModuleRecord
from cs336_systems.bench.suites import FSDP_MODULES_CPU
from cs336_systems.writeup import fmt
from cs336_systems.writeup.context import RenderContext
from cs336_systems.writeup.fsdp_options_section import bytes_within, ratio_reading

KIND = FsdpModuleRecord.KIND
WORLD_SIZES = (2, 3)  # the issue's
COMMAND = "python scripts/bench_fsdp_modules.py --world-size {n} " + " ".join(FSDP_MODULES_CPU)  # make bench's


def _run(results) -> dict:
    records: list[FsdpModuleRecord] = results.records
    rows, unfit = [], fmt.not_evidence(results.environment)
    for r in records:
        rows.append([r.case, r.description, f"{r.n_parameters / 1e6:.3g}M", fmt.ms(r.ours_median_s),
                     fmt.ms(r.torch_median_s), f"{r.ratio_median:.2f}", fmt.ratio_interval(r.ratio_ci95), ratio_reading(r, unfit),
                     f"{fmt.mb(r.ours_resident_bytes)} / {fmt.mb(r.torch_resident_bytes)}",
                     "yes" if bytes_within(r.ours_resident_bytes, r.torch_resident_bytes) else "no",
                     f"{fmt.mb(r.ours_peak_bytes)} / {fmt.mb(r.torch_peak_bytes)}", f"{r.max_weight_difference:.1e}"])
    readings = {r.case: ratio_reading(r, unfit) for r in records}
    s = results.setting
    return dict(
        n=results.environment.world_size, backend=results.environment.backend,
        setting=fmt.setting_line(results.environment, results.source, parts=[
            f"backend {results.environment.backend}", f"world size {results.environment.world_size}",
            f"d_model {s.get('d_model', '?')}, {s.get('num_layers', '?')} blocks, {s.get('num_heads', '?')} heads, "
            f"d_ff {s.get('d_ff', '?')}",
            f"global batch {s.get('global_batch', '?')} × {s.get('context_length', '?')} positions",
            f"{s.get('rounds', '?')} rounds"]),
        # Each reading present, in the order the rows first show it: the cases it applies to.
        by_reading={x: [c for c, y in readings.items() if y == x] for x in dict.fromkeys(readings.values())},
        bytes_within=[r.case for r in records if bytes_within(r.ours_resident_bytes, r.torch_resident_bytes)],
        cases=[r.case for r in records],
        largest_difference=max(r.max_weight_difference for r in records),
        table=fmt.table(["case", "what", "parameters", "ours (ms)", "torch's (ms)", "ours / torch's per round",
                         "95% interval", "reading", "held per rank, ours / torch's (MB)", "within 5%",
                         "peak (MB)", "weights apart"], rows, align="lllrrrrllllr"),
    )


def modules_runs(ctx: RenderContext) -> dict:
    """Every run (machines in tag order, each machine's by world size) and the issue's world sizes
    none measured."""
    found = [(machine.tag, results.environment.world_size, results) for machine, results in ctx.inputs.runs(KIND)]
    runs = [_run(results) for _, _, results in sorted(found, key=lambda x: x[:2]) if results.records]
    measured = {r["n"] for r in runs}
    missing = [n for n in WORLD_SIZES if n not in measured]
    return dict(runs=runs, missing=missing, commands=[COMMAND.format(n=n) for n in missing])
