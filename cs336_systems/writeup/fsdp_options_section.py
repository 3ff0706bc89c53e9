"""The FSDP page's options table: each option, our FSDP beside torch's ``fully_shard``, and the
accounting statement per option (what predict() said our step moves and holds, what was counted).

Reads ``fsdp_options.json`` (one :class:`FsdpOptionRecord` per option). A step-time ratio is a
finding only with its interval: "no slower" means the interval's upper end is at most 1, and
an interval holding 1 reads "indistinguishable here". Words in
``templates/details/fsdp_options.md.j2``, included by the FSDP page and the fsdp_accounting answer.
"""

from __future__ import annotations

import math

from cs336_systems.bench.fsdp.options_run import FsdpOptionRecord
from cs336_systems.bench.fsdp.record import COLLECTIVES
from cs336_systems.writeup import fmt
from cs336_systems.writeup.context import RenderContext

KIND = FsdpOptionRecord.KIND
BYTES_TOLERANCE = 0.05  # "bytes held within 5% of torch's"


def ratio_reading(r, unfit: str | None) -> str:
    """The verdict on a record's per-round step-time ratio (ours / torch's) from its 95% interval
    (``ratio_ci95``): every FSDP table beside torch's reads its rows by this rule, none in a run whose
    times are not evidence (``unfit``, fmt.not_evidence)."""
    if unfit:
        return f"not evidence: {unfit}"
    if r.ratio_ci95 is None:
        return "too few rounds for an interval"
    low, high = r.ratio_ci95
    if high <= 1.0:
        return "ours no slower" if low < 1.0 else "same"
    if low > 1.0:
        return "ours slower"
    return "indistinguishable here"


def bytes_within(a: float, b: float) -> bool:
    """Whether ``a`` bytes are within BYTES_TOLERANCE of ``b``."""
    return abs(a / b - 1) <= BYTES_TOLERANCE


def _same_bytes(counted: dict[str, float], predicted: dict[str, float]) -> bool:
    """Equal byte counts. The prediction is a float, which the writeup reads settled to
    ``load.INPUT_DIGITS`` significant digits: a count in the billions (the GPU run's gathers)
    loses its last digits."""
    return counted.keys() == predicted.keys() and all(
        math.isclose(counted[k], predicted[k], rel_tol=1e-8) for k in counted)


def _moved(payload: dict[str, float]) -> str:
    return ", ".join(f"{k.replace('_', '-')} {fmt.mb(payload[k])}" for k in COLLECTIVES if payload.get(k))


def _run(results) -> dict:
    records: list[FsdpOptionRecord] = results.records
    rows, accounting, unfit = [], [], fmt.not_evidence(results.environment)
    for r in records:
        rows.append([r.option, r.description, fmt.ms(r.ours_median_s), fmt.ms(r.torch_median_s),
                     f"{r.ratio_median:.2f}", fmt.ratio_interval(r.ratio_ci95), ratio_reading(r, unfit),
                     f"{fmt.mb(r.ours_resident_bytes)} / {fmt.mb(r.torch_resident_bytes)}",
                     "yes" if bytes_within(r.ours_resident_bytes, r.torch_resident_bytes) else "no",
                     f"{fmt.mb(r.ours_peak_bytes)} / {fmt.mb(r.torch_peak_bytes)}",
                     f"{fmt.mb(r.ours_activation_peak_bytes)} / {fmt.mb(r.torch_activation_peak_bytes)}",
                     " ".join(f"{k.replace('_', '-')} {r.ours_calls.get(k, 0)}/{r.torch_calls.get(k, 0)}"
                              for k in COLLECTIVES if r.ours_calls.get(k) or r.torch_calls.get(k))])
        counted = {k: v for k, v in r.ours_payload_bytes.items() if v}
        predicted = {k: v for k, v in r.predicted_payload_bytes.items() if v}
        accounting.append(dict(
            option=r.option, predicted=_moved(predicted), measured=_moved(counted),
            moved_equal=_same_bytes(counted, predicted), held_predicted=r.predicted_resident_bytes,
            held=r.ours_resident_bytes, held_torch=r.torch_resident_bytes))
    no_slower = [r.option for r in records if not unfit and r.ratio_ci95 is not None and r.ratio_ci95[1] <= 1.0]
    return dict(
        setting=fmt.workload_setting_line(results, f"{results.setting.get('rounds', '?')} rounds"), unfit=unfit,
        n_parameters=results.notes.get("n_parameters"), backend=results.environment.backend,
        n=results.environment.world_size, tag=results.environment.machine_tag, accounting=accounting,
        moved_mismatched=[a["option"] for a in accounting if not a["moved_equal"]],
        held_gap=max((abs(a["held"] / a["held_predicted"] - 1) for a in accounting if a["held_predicted"]), default=0.0),
        no_slower=no_slower, median_no_slower=[r.option for r in records if r.ratio_median <= 1.0],
        bytes_within=[r.option for r in records if bytes_within(r.ours_resident_bytes, r.torch_resident_bytes)],
        options=[r.option for r in records],
        table=fmt.table(["option", "what", "ours (ms)", "torch's (ms)", "ours / torch's per round",
                         "95% interval", "reading", "held per rank, ours / torch's (MB)", "within 5%",
                         "peak (MB)", "activations at peak (MB)", "collectives per step, ours/torch's"],
                        rows, align="llrrrrllllll"),
    )


def options_runs(ctx: RenderContext) -> list[dict]:
    """One entry per machine with an options run (none: the page says how to run it)."""
    return [_run(results) for _, results in ctx.inputs.runs(KIND) if results.records]
