"""The doctor's console report: the per-rank table, the calibration, and the findings or an OK line."""

from __future__ import annotations

import statistics

from cs336_systems import cli
from cs336_systems.doctor.report import DoctorReport
from cs336_systems.units import KB, MB


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def rank_table(report: DoctorReport) -> str:
    """One row per rank: where it runs, when it checked in, its samples and its step times."""
    rows = [[r.rank, r.local_rank, r.hostname[:16], r.device, r.pid,
             "never" if r.checkin_s is None else f"{r.checkin_s:.2f}", r.samples, _ms(r.step_s), _ms(r.compute_s),
             _ms(r.fastest_compute_s), _ms(r.wait_s)] for r in report.ranks]
    header = ["rank", "local", "host", "device", "pid", "check-in s", "samples", "step ms", "compute ms", "fastest",
              "wait ms"]
    return cli.format_table(header, rows, right=lambda i: i not in (2, 3))


def format_report(report: DoctorReport) -> str:
    """The per-rank table, the calibration, and the findings (or an OK summary)."""
    first = report.ranks[0]
    lines = [
        f"DDP doctor: {first.world_size} ranks, backend {first.backend}, model {report.model_size} "
        f"({report.parameter_count / 1e6:.2f}M parameters, {report.gradient_bytes / MB:.2f} MB of gradients)"
        + (f", injected fault: {report.inject}" if report.inject else ""),
        rank_table(report),
        "(compute: forward + backward, median and fastest step; wait: in "
        "finish_gradient_synchronization, for the other ranks' gradients)",
    ]
    if report.calibration:
        timings = ", ".join(f"{row.payload_bytes / KB:g} KB {_ms(row.median_s)} ms" for row in report.calibration)
        lines.append(f"all-reduce (slowest rank, median): {timings}")
    if report.allreduce_o_s is not None and report.allreduce_w_bytes_per_s is not None:
        r2 = "no fit" if report.fit_r2 is None else f"r2 {report.fit_r2:.3f}"
        lines.append(f"time = o + bytes / w: o = {report.allreduce_o_s * 1e6:.1f} us, "
                     f"w = {report.allreduce_w_bytes_per_s / 1e9:.3f} GB/s ({r2})")
    if report.suggested_bucket_bytes is not None:
        lines.append(
            f"suggested bucket: {report.suggested_bucket_bytes / MB:.2f} MB, the overhead model's sqrt(s w o) for "
            f"s = {report.gradient_bytes / MB:.2f} MB of gradients (largest parameter "
            f"{report.largest_param_bytes / MB:.2f} MB; see cs336_systems/ddp/overhead_model.py): "
            "BucketedDDP(bucket_size_mb=...)"
        )
    lines += [f"note: {note}" for note in report.notes]
    if report.ok:
        lines.append(f"OK: all {first.world_size} ranks checked in; shards disjoint and cover the data; "
                     "parameters agree after wrapping and after training; no straggler")
    else:
        lines.append(f"FOUND {len(report.findings)} problem{'s' if len(report.findings) > 1 else ''}:")
        lines += [f"  {i}. {finding}" for i, finding in enumerate(report.findings, start=1)]
    return "\n".join(lines)


def exit_status(report: DoctorReport) -> int:
    """0 when healthy, 1 when something was found."""
    return 0 if report.ok else 1


def format_job_report(ranks: list, findings: list[str]) -> str:
    """The in-job doctor's report (in_job.py): one row per rank, then the findings."""
    def median_ms(values: list[float]) -> str:
        return _ms(statistics.median(values)) if values else "-"

    rows = [[r.rank, r.world_size, r.backend, r.hostname[:16], r.device, r.sampler or "-", r.batches_per_epoch or "-",
             r.batches, r.samples, r.optimizer_steps, median_ms(r.step_s), median_ms(r.compute_s),
             _ms(min(r.compute_s[1:])) if len(r.compute_s) > 1 else "-", median_ms(r.data_wait_s)] for r in ranks]
    header = ["rank", "world", "backend", "host", "device", "sampler", "per epoch", "batches", "samples", "steps",
              "step ms", "compute ms", "fastest", "data ms"]
    lines = [f"DDP doctor, inside the job: {len(ranks)} ranks", cli.format_table(header, rows, right=lambda i: i > 5),
             "(compute: the batch's forward to the end of backward's own work, before DDP's reduction; "
             "data: an optimizer step to the next batch's start)",
             f"FOUND {len(findings)} problem{'s' if len(findings) > 1 else ''}:"]
    lines += [f"  {i}. {finding}" for i, finding in enumerate(findings, start=1)]
    return "\n".join(lines)
