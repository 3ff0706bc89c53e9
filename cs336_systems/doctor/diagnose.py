"""From every rank's gathered measurements to the report of one scenario: pure, no process group.

Each finder of findings.py runs over the measurements; what is wrong becomes a finding (exit
status 1), what is worth knowing a note; the calibration's o and w give the suggested bucket.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cs336_systems.ddp.auto_bucket import AllReduceCalibration
from cs336_systems.ddp.overhead_model import optimal_bucket_bytes
from cs336_systems.doctor.findings import (
    STAGE_CAUSES,
    find_missing_ranks,
    find_parameter_mismatches,
    find_shard_problems,
    find_stragglers,
)
from cs336_systems.doctor.report import CalibrationRow, DoctorReport
from cs336_systems.doctor.setting import DoctorSetting


def build_report(
    gathered: list[dict[str, Any]], setting: DoctorSetting, inject: str | None, calibration: AllReduceCalibration | None
) -> DoctorReport:
    """The report of one scenario from every rank's measurements (rank 0's first). Pure."""
    main = gathered[0]
    ranks = [replace(g["info"], checkin_s=arrival) for g, arrival in zip(gathered, main["arrivals"])]
    n = len(ranks)
    findings = find_missing_ranks([r.checkin_s for r in ranks], setting.checkin_timeout_s)
    findings += find_shard_problems([g["indices"] for g in gathered], setting.dataset_len)
    for stage in STAGE_CAUSES:
        if stage not in main["checksums"]:
            continue
        mismatches = find_parameter_mismatches([g["checksums"][stage] for g in gathered], main["names"], stage)
        if mismatches:
            findings += mismatches  # later stages inherit the difference: report the first only
            break
    findings += find_stragglers(
        [r.fastest_compute_s for r in ranks],
        setting.straggler_factor,
        setting.straggler_min_excess_s,
        [r.load_per_core for r in ranks],
    )

    notes = []
    padding = (-setting.dataset_len) % n
    if padding:
        notes.append(
            f"DistributedSampler repeats {padding} of {setting.dataset_len} samples so that "
            f"{n} ranks get equal shards (drop_last=False); metrics over an epoch count them twice"
        )
    busy = {r.hostname: r.load_per_core for r in ranks if r.load_per_core is not None and r.load_per_core > 1}
    for host, load in busy.items():
        notes.append(
            f"host {host} is oversubscribed (load average {load:.1f} per core): other processes "
            "compete for its CPUs, so its times are noisy"
        )
    sizes = main["sizes"]
    s, largest = sum(sizes), max(sizes)
    rows, o, w, r2, bucket = [], None, None, None, None
    if calibration is None:
        notes.append("world size 1: nothing to compare, and no all-reduce cost to measure")
    else:
        rows = [CalibrationRow(b, t, ok) for b, t, ok in
                zip(calibration.payload_bytes, calibration.seconds, calibration.correct)]
        wrong = [row.payload_bytes for row in rows if not row.correct]
        if wrong:
            findings.append(f"all-reduce returned wrong sums for payloads of {wrong} bytes: the backend is broken")
        if calibration.note:
            notes.append(calibration.note)
        o, w, r2 = calibration.o_s, calibration.w_bytes_per_s, calibration.r2
        bucket = optimal_bucket_bytes(s, w, o, largest)
    return DoctorReport(
        inject, setting.model_size, main["parameter_count"], s, largest, ranks, rows, o, w, r2, bucket, findings, notes
    )
