"""Problem distributed_communication_single_node: the all-reduce benchmark's table, plot and reading."""

from __future__ import annotations

from cs336_systems.writeup import fmt
from cs336_systems.writeup.allreduce_analysis import CommGroup, Record, comm_groups, saturation_point
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import not_measured_notes
from cs336_systems.writeup.allreduce_figure import allreduce_figure
from cs336_systems.writeup.load import MachineResults, ResultsFile

BENCHMARK = "allreduce"
SATURATION = 0.9  # "saturated": busbw within 10% of the largest busbw measured for that line


def _device_label(record: Record) -> str:
    if record.get("shared_gpu"):
        return f"{record.get('device_type', 'cuda')} (gloo ranks sharing one GPU)"
    return record.get("device_type", "cpu")


def allreduce_table(records: list[Record]) -> str:
    rows = []
    ordered = sorted(
        records, key=lambda r: (r["backend"], r.get("device_type", ""), r["world_size"], r["payload_bytes"])
    )
    for r in ordered:
        head = [r["backend"], _device_label(r), r["world_size"], fmt.size_mb(r["payload_mb"])]
        if r.get("skipped") or r.get("median_s") is None:
            rows.append(head + ["0", "–", "–", "–", "–", "–", f"skipped: {r.get('reason') or 'no times'}"])
            continue
        check = {True: "correct", False: "**WRONG**"}.get(r.get("correct"), "unchecked")
        rows.append(head + [
            r["timed_iters"],
            fmt.ms(r["median_s"]),
            f"{fmt.ms(r['p10_s'])}–{fmt.ms(r['p90_s'])}",
            f"{fmt.ms(r['min_s'])}–{fmt.ms(r['max_s'])}",
            fmt.sig(r["algbw_gbps"]),
            fmt.sig(r["busbw_gbps"]),
            check,
        ])
    headers = ["backend", "device", "ranks", "payload (MB)", "timed iters", "median (ms)", "p10–p90 (ms)",
               "min–max (ms)", "algbw (GB/s)", "busbw (GB/s)", "result"]
    return fmt.table(headers, rows, align="llrrrrrrrrl")


def _saturation_sentence(kind: str, groups: dict[CommGroup, list[Record]]) -> str:
    peaks = [(g, saturation_point(rs)[0]) for g, rs in groups.items()]
    peak_group, peak = max(peaks, key=lambda gp: gp[1]["busbw_gbps"])
    reached, at_edge = [], 0
    for group, records in groups.items():
        _, first = saturation_point(records, SATURATION)
        reached.append(f"{fmt.size_mb(first['payload_mb'])} MB with {group.world_size} ranks")
        at_edge += len(records) > 1 and first is records[-1]
    sentence = (
        f"For {kind}, bus bandwidth peaks at {fmt.sig(peak['busbw_gbps'])} GB/s ({peak_group.world_size} ranks, "
        f"{fmt.size_mb(peak['payload_mb'])} MB); each line first comes within {fmt.pct(1 - SATURATION, 2)} "
        "of its own peak at " + ", ".join(reached)
    )
    if at_edge:
        lines = "every line" if at_edge == len(groups) else f"{at_edge} of {len(groups)} lines"
        sentence += (f" (for {lines} that is the largest payload measured, so bandwidth may still be rising "
                     "beyond it)")
    return sentence + "."


def _fixed_cost_sentence(kind: str, groups: dict[CommGroup, list[Record]]) -> str | None:
    group, records = next(iter(groups.items()))
    if len(records) < 2:
        return None
    small, next_ = records[0], records[1]
    bytes_ratio = next_["payload_bytes"] / small["payload_bytes"]
    time_ratio = next_["median_s"] / small["median_s"]
    sentence = (
        f"With {group.world_size} ranks, going from {fmt.size_mb(small['payload_mb'])} to "
        f"{fmt.size_mb(next_['payload_mb'])} MB ({fmt.ratio(bytes_ratio)} the bytes) changes the median time "
        f"from {fmt.ms(small['median_s'])} to {fmt.ms(next_['median_s'])} ms ({fmt.ratio(time_ratio)})"
    )
    # Time growing far slower than bytes means a fixed cost per call dominates those payloads.
    if time_ratio < bytes_ratio / 2:
        sentence += ": at these sizes the cost per call, not the bytes, sets the time"
    return sentence + "."


def _world_size_sentence(kind: str, groups: dict[CommGroup, list[Record]]) -> str | None:
    if len(groups) < 2:
        return None
    by_size = [{r["payload_bytes"]: r for r in rs} for rs in groups.values()]
    common = set.intersection(*(set(d) for d in by_size))
    if not common:
        return None
    payload = max(common)
    lines = list(groups)
    first, last = lines[0], lines[-1]
    a, b = by_size[0][payload], by_size[-1][payload]
    # Ring all-reduce moves 2(n-1)/n of the payload through each rank (nccl-tests PERFORMANCE.md).
    expected = (2 * (last.world_size - 1) / last.world_size) / (2 * (first.world_size - 1) / first.world_size)
    return (
        f"At {fmt.size_mb(a['payload_mb'])} MB, going from {first.world_size} to {last.world_size} ranks multiplies "
        f"the median time by {fmt.ratio(b['median_s'] / a['median_s'])} ({fmt.ms(a['median_s'])} → "
        f"{fmt.ms(b['median_s'])} ms); the bytes each rank sends in a ring grow by {fmt.ratio(expected)}, "
        f"and busbw changes by {fmt.ratio(b['busbw_gbps'] / a['busbw_gbps'])}."
    )


def commentary(records: list[Record]) -> str:
    """A few sentences per backend and device, each computed from the records."""
    groups = comm_groups(records)
    kinds: dict[tuple, dict[CommGroup, list[Record]]] = {}
    for group, rs in groups.items():
        kinds.setdefault((group.backend, group.device_type, group.shared_gpu), {})[group] = rs
    paragraphs = []
    for (backend, device, shared), kind_groups in kinds.items():
        kind = f"{backend} on {device}" + (" (gloo ranks sharing one GPU)" if shared else "")
        sentences = [_saturation_sentence(kind, kind_groups), _fixed_cost_sentence(kind, kind_groups),
                     _world_size_sentence(kind, kind_groups)]
        paragraphs.append(" ".join(s for s in sentences if s))
    return "\n\n".join(paragraphs) if paragraphs else "No payload was measured (every setting was skipped)."


def allreduce_section(ctx: RenderContext) -> Section:
    out = ["## distributed_communication_single_node: all-reduce benchmark", "",
           "Median time of one `all_reduce` of a float32 payload (slowest rank per iteration) with its spread, "
           "algbw = bytes / time and busbw = algbw · 2(n−1)/n (nccl-tests' definitions), per backend, "
           "world size and payload."]
    figures = []
    for machine, results in ctx.inputs.runs(BENCHMARK):
        meta, records = results.meta, results.records
        world_sizes = sorted({r["world_size"] for r in records})
        backends = sorted({r["backend"] for r in records})
        iters = meta.get("timed_iters")
        parts = [f"backend {', '.join(backends)}", f"world sizes {', '.join(map(str, world_sizes))}"]
        if iters:
            parts.append(f"{iters} timed iterations asked per payload after {meta.get('warmup_iters', 0)} warm-up")
        shared = [bool(r.get("shared_gpu")) for r in records]
        if any(shared) and not all(shared):
            parts.append("rows marked so: gloo ranks sharing one GPU")
        out += ["", fmt.run_heading(machine, results), "",
                fmt.setting_line(meta, results.source, parts=parts, shared_gpu=all(shared) and bool(shared)), "",
                allreduce_table(records)]
        groups = comm_groups(records)
        if groups:
            path = allreduce_figure(groups, f"all-reduce on {fmt.hardware(meta, meta.get('device_type'))}",
                                    ctx.figure_path(f"{machine.tag}_{results.name}_allreduce.png"))
            figures.append(path)
            out += ["", ctx.image(path, f"all-reduce time and busbw against payload on {machine.tag}")]
        out += ["", commentary(records)]
    notes = not_measured_notes(ctx.inputs, BENCHMARK, "All-reduce benchmark")
    if notes:
        out += ["", "### Not measured here", "", notes]
    return Section("\n".join(out), figures)
