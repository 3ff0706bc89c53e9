"""The FSDP page's modules table, from planted results files (nothing spawns a process).

A 2-rank run of three cases with known readings: ours faster than torch's every round (interval
below 1), alternating (interval holding 1), slower every round; bytes held within and beyond 5%
of torch's. Without a 3-rank file the page says once that 3 ranks were not measured, and with
one it says nothing of the kind.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import pytest

from cs336_systems.bench.fsdp.modules_run import FsdpModuleRecord, FsdpModulesSetting
from cs336_systems.bench.stats import median_interval
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import results_path
from cs336_systems.results.schema import to_json
from cs336_systems.units import MB
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.fsdp_section import fsdp_page
from cs336_systems.writeup.pages import machines_page

from .test_writeup_fsdp import TAG, environment

pytestmark = pytest.mark.problem("fsdp")
ROUNDS = 8
HEADING = "## torch's modules, ours beside fully_shard"


def record(case: str, ratios: list[float], held: tuple[float, float], world_size: int = 2) -> FsdpModuleRecord:
    theirs = [1.0 + 0.01 * i for i in range(ROUNDS)]
    ours = [t * r for t, r in zip(theirs, ratios)]
    per_round = [a / b for a, b in zip(ours, theirs)]
    interval = median_interval(per_round)
    return FsdpModuleRecord(
        case=case, description=f"the {case} case", world_size=world_size, n_parameters=1_234_000,
        ours_step_times_s=ours, torch_step_times_s=theirs,
        ours_median_s=statistics.median(ours), torch_median_s=statistics.median(theirs),
        ratio_median=statistics.median(per_round), ratio_ci95=list(interval) if interval else None,
        ours_resident_bytes=held[0], torch_resident_bytes=held[1], ours_peak_bytes=20 * MB, torch_peak_bytes=21 * MB,
        max_weight_difference=3e-7,
    )


def render(tmp_path: Path, world_sizes: tuple[int, ...]) -> str:
    root = tmp_path / "results"
    for n in world_sizes:
        records = [
            record("encoder", [0.8] * ROUNDS, (10 * MB, 10.2 * MB), n),
            record("tied", [0.9 if i % 2 else 1.1 for i in range(ROUNDS)], (10 * MB, 12 * MB), n),
            record("bf16", [1.2] * ROUNDS, (10 * MB, 10 * MB), n),
        ]
        setting = FsdpModulesSetting(world_size=n, rounds=ROUNDS)
        env = dataclasses.replace(environment(), world_size=n)
        write_results(results_path(FsdpModuleRecord.KIND, TAG, setting.results_suffix, root=root),
                      ResultsFile(FsdpModuleRecord.KIND, env, to_json(setting), records))
    rendered = render_writeup(root, tmp_path / "out", pages=[fsdp_page, machines_page])
    return rendered.details[0].read_text().split(HEADING)[1].split("\n## ")[0]


def test_every_row_read_by_its_interval_and_bytes_checked(tmp_path: Path):
    section = render(tmp_path, (2,))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in section.splitlines() if line.startswith("| ") and not line.startswith("| case")}
    assert rows["encoder"][5] == "0.80" and rows["encoder"][7] == "ours no slower"
    assert rows["tied"][7] == "indistinguishable here"
    assert rows["bf16"][5] == "1.20" and rows["bf16"][7] == "ours slower"
    assert [rows[c][9] for c in ("encoder", "tied", "bf16")] == ["yes", "no", "yes"]
    assert rows["encoder"][2] == "1.23M" and rows["encoder"][11] == "3.0e-07"
    assert ("At 2 ranks: ours no slower: encoder; indistinguishable here: tied; ours slower: bf16; "
            "bytes held within 5% of torch's: encoder, bf16 (not: tied)") in section
    assert "world size 2" in section and "other jobs 0.00 runnable" in section  # the planted run's load
    assert section.count("Not measured here") == 1 and "Not measured here: 3 ranks" in section


def test_both_world_sizes_measured_leave_nothing_unmeasured(tmp_path: Path):
    section = render(tmp_path, (2, 3))
    assert "At 2 ranks:" in section and "At 3 ranks:" in section and "world size 3" in section
    assert "Not measured" not in section


def test_no_run_at_all_is_said_once(tmp_path: Path):
    section = render(tmp_path, ())
    assert section.count("Not measured here") == 1 and "2 and 3 ranks" in section
    assert "| case" not in section
