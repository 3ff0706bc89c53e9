"""Problem distributed_communication_single_node: the all-reduce benchmark's table, plot and reading.

Every sentence is computed from a results file's records and environment. A difference between
two medians is stated only when their p10–p90 ranges do not overlap; otherwise the text says
"indistinguishable here". Where the setting explains a number (more ranks than cores, gloo
staging GPU tensors through the host, ranks sharing a GPU), the text says so.
"""

from __future__ import annotations

from cs336_systems.bench.allreduce.record import AllReduceRecord, bus_bandwidth_factor
from cs336_systems.results.environment import Environment
from cs336_systems.writeup import fmt
from cs336_systems.writeup.allreduce_analysis import (
    CommGroup,
    comm_groups,
    levels_off_at,
    ranks_per_core,
    spreads_overlap,
    time_sharing_bound,
)
from cs336_systems.writeup.allreduce_figure import allreduce_figure
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import not_measured_notes

BENCHMARK = AllReduceRecord.KIND
Groups = dict[CommGroup, list[AllReduceRecord]]

METHOD = (
    "Median time of one `all_reduce` of a float32 payload, with its spread, algbw = bytes / time and "
    "busbw = algbw · 2(n−1)/n (nccl-tests' definitions), per backend, world size and payload. Each payload "
    "first runs its warm-up iterations untimed; each timed iteration is a barrier, a device sync, the clock, "
    "the all-reduce, a device sync and the clock, and its time is the slowest rank's (an all-reduce is over "
    "when its last rank is). The reduced values of the first and last timed iterations are checked against "
    "the closed-form sum over ranks. Two medians whose p10–p90 ranges overlap are called indistinguishable "
    "here: no ranking is read into them."
)
HOST_COPY = (
    "gloo does not reduce CUDA tensors on the GPU: without a GPUDirect transport (its TCP transport has none) "
    "each all-reduce copies the payload into pinned host memory, runs gloo's CPU ring there and copies the "
    "result back (`AsyncAllreduceCUDAHostWork` in PyTorch's `ProcessGroupGlooCuda.cpp`), so these bandwidths "
    "are bound by the host's copies and CPU reduction, not by the GPUs' links"
)


def _device_label(r: AllReduceRecord) -> str:
    return f"{r.device_type} (gloo ranks sharing one GPU)" if r.shared_gpu else r.device_type


def allreduce_table(records: list[AllReduceRecord]) -> str:
    rows = []
    for r in sorted(records, key=lambda r: (r.backend, r.device_type, r.world_size, r.payload_bytes)):
        head = [r.backend, _device_label(r), r.world_size, fmt.size_mb(r.payload_mb)]
        if not r.measured:
            rows.append(head + ["0", "–", "–", "–", "–", "–", f"skipped: {r.skip_reason or 'no times'}"])
            continue
        check = {True: "correct", False: "**WRONG**"}.get(r.correct, "unchecked")  # type: ignore[arg-type]
        rows.append(head + [r.timed_iters, fmt.ms(r.median_s), f"{fmt.ms(r.p10_s)}–{fmt.ms(r.p90_s)}",
                            f"{fmt.ms(r.min_s)}–{fmt.ms(r.max_s)}", fmt.sig(r.algbw_gbps), fmt.sig(r.busbw_gbps),
                            check])
    headers = ["backend", "device", "ranks", "payload (MB)", "timed iters", "median (ms)", "p10–p90 (ms)",
               "min–max (ms)", "algbw (GB/s)", "busbw (GB/s)", "result"]
    return fmt.table(headers, rows, align="llrrrrrrrrl")


def _spread_ms(r: AllReduceRecord) -> str:
    return f"{fmt.ms(r.p10_s)}–{fmt.ms(r.p90_s)}"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _saturation_sentence(kind: str, groups: Groups) -> str:
    peak = max((r for rs in groups.values() for r in rs), key=lambda r: r.busbw_gbps)  # type: ignore[arg-type]
    low, high = peak.busbw_range_gbps()
    reached, rising = [], []
    for group, records in groups.items():
        _, first = levels_off_at(records)
        if len(records) > 1 and first is records[-1]:
            rising.append(str(group.world_size))
        else:
            reached.append(f"{fmt.size_mb(first.payload_mb)} MB with {group.world_size} ranks")
    sentence = (f"For {kind}, the highest busbw measured is {fmt.sig(peak.busbw_gbps)} GB/s ({peak.world_size} ranks, "
                f"{fmt.size_mb(peak.payload_mb)} MB; {fmt.sig(low)}–{fmt.sig(high)} GB/s at its p90 and p10 times).")
    if reached:
        sentence += (" Busbw is indistinguishable here from its line's peak (the busbw ranges overlap) from "
                     + _and(reached) + " on: past that size the bytes, not the cost per call, set the time.")
    if rising:
        lines = "that line" if len(rising) == 1 else "those lines"
        sentence += (f" With {_and(rising)} ranks busbw is still rising at the largest payload measured, so {lines} "
                     "may not have reached the rate the links allow.")
    return sentence


def _fixed_cost_sentence(groups: Groups) -> str | None:
    group, records = next(iter(groups.items()))
    if len(records) < 2:
        return None
    small, next_ = records[0], records[1]
    bytes_ratio = next_.payload_bytes / small.payload_bytes
    head = (f"With {group.world_size} ranks, going from {fmt.size_mb(small.payload_mb)} to "
            f"{fmt.size_mb(next_.payload_mb)} MB ({fmt.ratio(bytes_ratio)} the bytes)")
    if spreads_overlap(small, next_):
        return (f"{head} leaves the time indistinguishable here ({_spread_ms(small)} against {_spread_ms(next_)} ms, "
                "p10–p90): at these sizes a fixed cost per call, not the bytes, sets the time.")
    time_ratio = next_.median_s / small.median_s  # type: ignore[operator]
    sentence = (f"{head} changes the median time from {fmt.ms(small.median_s)} to {fmt.ms(next_.median_s)} ms "
                f"({fmt.ratio(time_ratio)})")
    # Time growing far slower than bytes means a fixed cost per call dominates those payloads.
    if time_ratio < bytes_ratio / 2:
        sentence += ": at these sizes the cost per call, not the bytes, sets the time"
    return sentence + "."


def _oversubscription_sentence(groups: Groups, env: Environment) -> str | None:
    crowded = [(g.world_size, ranks_per_core(g.world_size, env.cpu_count)) for g in groups]
    crowded = [(n, share) for n, share in crowded if share is not None]
    if not crowded:
        return None
    sizes = _and([str(n) for n, _ in crowded])
    shares = _and([f"{share:.3g}" for _, share in crowded])
    return (f"With {sizes} ranks on {env.cpu_count} logical cores the ranks outnumber the cores "
            f"({shares} ranks per core): they take turns on the cores, so each rank's share of the ring's work "
            "also waits for a core, and time grows with ranks beyond the core count on top of the ring's bytes.")


def _world_size_sentence(groups: Groups, env: Environment) -> str | None:
    if len(groups) < 2:
        return None
    by_size = [{r.payload_bytes: r for r in rs} for rs in groups.values()]
    common = set.intersection(*(set(d) for d in by_size))
    if not common:
        return None
    payload = max(common)
    first, last = list(groups)[0], list(groups)[-1]
    a, b = by_size[0][payload], by_size[-1][payload]
    ring = bus_bandwidth_factor(last.world_size) / bus_bandwidth_factor(first.world_size)
    head = f"At {fmt.size_mb(a.payload_mb)} MB, going from {first.world_size} to {last.world_size} ranks"
    if spreads_overlap(a, b):
        return (f"{head} leaves the time indistinguishable here ({_spread_ms(a)} against {_spread_ms(b)} ms, "
                f"p10–p90), although the bytes each rank sends in a ring grow by {fmt.ratio(ring)}.")
    sentence = (f"{head} multiplies the median time by {fmt.ratio(b.median_s / a.median_s)} "  # type: ignore[operator]
                f"({fmt.ms(a.median_s)} → {fmt.ms(b.median_s)} ms); the bytes each rank sends in a ring "
                f"(2(n−1)/n of the payload) grow by {fmt.ratio(ring)}, and busbw changes by "
                f"{fmt.ratio(b.busbw_gbps / a.busbw_gbps)}")  # type: ignore[operator]
    if first.device_type == "cpu" and env.cpu_count and last.world_size > env.cpu_count:
        bound = time_sharing_bound(first.world_size, last.world_size, env.cpu_count)
        sentence += (f". Were every byte's work queued for the {env.cpu_count} cores, the time would grow by "
                     f"{fmt.ratio(bound)} (the ring's factor times the growth in ranks per core); "
                     + _against_bounds(b.median_s / a.median_s, ring, bound))  # type: ignore[operator]
    return sentence + "."


def _against_bounds(measured: float, ring: float, bound: float) -> str:
    """Where a measured time ratio falls between the ring's bytes alone and full sharing of the cores."""
    if measured < ring:
        return (f"the measured {fmt.ratio(measured)} is below even the ring's factor, so at this size neither the "
                "bytes nor the sharing of cores sets the time")
    if measured <= bound:
        return (f"the measured {fmt.ratio(measured)} lies between the two: more bytes per rank, and part of the "
                "ranks' work waiting for a core")
    return (f"the measured {fmt.ratio(measured)} exceeds both: beyond the bytes and the shared cores, something "
            "else (memory bandwidth shared by all ranks, the scheduler's switches between them) adds time")


def _gpu_sentences(backend: str, device: str, shared: bool, groups: Groups, env: Environment) -> list[str]:
    if device != "cuda":
        return []
    out = []
    if backend == "gloo":
        out.append(HOST_COPY[0].upper() + HOST_COPY[1:] + ".")
    if shared:
        gpus = f"{env.gpu_count} GPU{'s' if env.gpu_count != 1 else ''}" if env.gpu_count else "fewer GPUs"
        ranks = _and([str(g.world_size) for g in groups])
        out.append(f"The {ranks} ranks of these lines take turns on {gpus}: their copies and kernels time-share "
                   "each device, so adding ranks adds queueing on the GPU as well as bytes.")
    return out


def _correctness_sentence(records: list[AllReduceRecord]) -> str:
    measured = [r for r in records if r.measured]
    wrong = [r for r in measured if r.correct is False]
    if not measured:
        return ""
    if not wrong:
        return f"All {len(measured)} measured settings reduced to the exact expected sums."
    rows = _and([f"{r.backend} × {r.world_size} at {fmt.size_mb(r.payload_mb)} MB" for r in wrong])
    return f"**Wrong reduced values** in {rows}: their times are not those of a correct all-reduce."


def commentary(records: list[AllReduceRecord], env: Environment) -> str:
    """A paragraph per backend and device, each sentence computed from the records and environment."""
    kinds: dict[tuple[str, str, bool], Groups] = {}
    for group, rs in comm_groups(records).items():
        kinds.setdefault((group.backend, group.device_type, group.shared_gpu), {})[group] = rs
    paragraphs = []
    for (backend, device, shared), groups in kinds.items():
        kind = f"{backend} on {device}" + (" (gloo ranks sharing one GPU)" if shared else "")
        sentences = [_saturation_sentence(kind, groups), _fixed_cost_sentence(groups)]
        if device == "cpu":
            sentences.append(_oversubscription_sentence(groups, env))
        sentences.append(_world_size_sentence(groups, env))
        sentences += _gpu_sentences(backend, device, shared, groups, env)
        paragraphs.append(" ".join(s for s in sentences if s))
    if not paragraphs:
        return "No payload was measured (every setting was skipped)."
    return "\n\n".join(paragraphs + [_correctness_sentence(records)])


def _setting_parts(records: list[AllReduceRecord]) -> list[str]:
    backends = sorted({r.backend for r in records})
    world_sizes = sorted({r.world_size for r in records})
    parts = [f"backend {', '.join(backends)}", f"world sizes {', '.join(map(str, world_sizes))}"]
    asked = sorted({(r.requested_timed_iters, r.requested_warmup_iters) for r in records})
    parts += [f"{timed} timed iterations asked per payload after {warmup} warm-up" for timed, warmup in asked]
    threads = sorted({(r.world_size, r.threads_per_rank) for r in records if r.threads_per_rank})
    if threads and len({t for _, t in threads}) == 1:
        parts.append(f"{threads[0][1]} torch thread{'s' if threads[0][1] > 1 else ''} per rank")
    elif threads:
        parts.append("torch threads per rank " + ", ".join(f"{t} with {n} ranks" for n, t in threads))
    shared = {r.shared_gpu for r in records}
    if shared == {True, False}:
        parts.append("rows marked so: gloo ranks sharing one GPU")
    return parts


def allreduce_section(ctx: RenderContext) -> Section:
    out = ["## distributed_communication_single_node: all-reduce benchmark", "", METHOD]
    figures = []
    for machine, results in ctx.inputs.runs(BENCHMARK):
        records, env = results.records, results.environment
        out += ["", fmt.run_heading(machine, results), "",
                fmt.setting_line(env, results.source, parts=_setting_parts(records)), "", allreduce_table(records)]
        groups = comm_groups(records)
        if groups:
            path = allreduce_figure(groups, f"all-reduce on {fmt.hardware(env)}",
                                    ctx.figure_path(f"{machine.tag}_{results.name}_allreduce.png"))
            figures.append(path)
            out += ["", ctx.image(path, f"all-reduce time and busbw against payload on {machine.tag}")]
        out += ["", commentary(records, env)]
    notes = not_measured_notes(ctx.inputs, BENCHMARK, "All-reduce benchmark")
    if notes:
        out += ["", "### Not measured here", "", notes]
    return Section("\n".join(out), figures)
