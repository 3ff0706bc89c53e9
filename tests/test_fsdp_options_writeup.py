"""The FSDP page's options table and the per-option accounting statement, from a planted results file.

Three options with known readings: ours faster than torch's in every round (interval below 1),
ours alternating faster and slower (interval holding 1), ours slower every round; bytes held
within and beyond 5% of torch's; one prediction that matches what was counted and one that
does not. Nothing spawns a process.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from cs336_systems.bench.fsdp.options_run import FsdpOptionRecord, FsdpOptionsSetting
from cs336_systems.bench.stats import median_interval
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import results_path
from cs336_systems.results.schema import to_json
from cs336_systems.units import MB
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.render import heading
from cs336_systems.writeup.fsdp_section import fsdp_page
from cs336_systems.writeup.pages import machines_page

from .test_writeup_fsdp import TAG, environment

pytestmark = pytest.mark.problem("fsdp")
ROUNDS = 8
SETTING = FsdpOptionsSetting(model_size="tiny", context_length=32, global_batch=8, rounds=ROUNDS)


def record(option: str, ratios: list[float], held: tuple[float, float], predicted_gather: float) -> FsdpOptionRecord:
    theirs = [1.0 + 0.01 * i for i in range(ROUNDS)]
    ours = [t * r for t, r in zip(theirs, ratios)]
    per_round = [a / b for a, b in zip(ours, theirs)]
    interval = median_interval(per_round)
    payload = {"all_gather": 3 * MB, "reduce_scatter": 2 * MB}
    return FsdpOptionRecord(
        option=option, description=f"the {option} option", world_size=2,
        ours_step_times_s=ours, torch_step_times_s=theirs,
        ours_median_s=statistics.median(ours), torch_median_s=statistics.median(theirs),
        ratio_median=statistics.median(per_round), ratio_ci95=list(interval) if interval else None,
        ours_resident_bytes=held[0], torch_resident_bytes=held[1], ours_peak_bytes=20 * MB, torch_peak_bytes=21 * MB,
        ours_activation_peak_bytes=5 * MB, torch_activation_peak_bytes=6 * MB,
        ours_calls={"all_gather": 15, "reduce_scatter": 8}, torch_calls={"all_gather": 8, "reduce_scatter": 4},
        ours_payload_bytes=payload, torch_payload_bytes=payload,
        predicted_payload_bytes={"all_gather": predicted_gather, "reduce_scatter": 2 * MB, "all_reduce": 0.0},
        predicted_resident_bytes=held[0],
    )


def render(tmp_path: Path) -> tuple[str, str]:
    root = tmp_path / "results"
    records = [
        record("defaults", [0.8] * ROUNDS, (10 * MB, 10.2 * MB), 3 * MB),
        record("no-reshard", [0.9 if i % 2 else 1.1 for i in range(ROUNDS)], (10 * MB, 12 * MB), 3 * MB),
        record("bf16", [1.2] * ROUNDS, (10 * MB, 10 * MB), 4 * MB),
    ]
    write_results(results_path(FsdpOptionRecord.KIND, TAG, root=root),
                  ResultsFile(FsdpOptionRecord.KIND, environment(), to_json(SETTING), records))
    rendered = render_writeup(root, tmp_path / "out", pages=[fsdp_page, machines_page])
    readme = rendered.readme.read_text()
    return readme.split(heading("fsdp_accounting") + "\n")[1].split("\n## ")[0], rendered.details[0].read_text()


def test_options_table_reads_each_ratio_by_its_interval_and_checks_bytes(tmp_path: Path):
    _, details = render(tmp_path)
    section = details.split("## Options, ours beside torch's fully_shard")[1]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in section.splitlines() if line.startswith("| ") and not line.startswith("| option")}
    assert rows["defaults"][4] == "0.80" and rows["defaults"][6] == "ours no slower"
    assert rows["no-reshard"][6] == "indistinguishable here"
    assert rows["bf16"][4] == "1.20" and rows["bf16"][6] == "ours slower"
    assert [rows[o][8] for o in ("defaults", "no-reshard", "bf16")] == ["yes", "no", "yes"]
    assert "No slower than `fully_shard` (the interval's upper end at most 1): defaults;" in section
    assert "Bytes held within 5% of torch's: defaults, bf16 (not: no-reshard)." in section


def test_accounting_states_prediction_beside_measurement_per_option(tmp_path: Path):
    """The details page has a line per option, the ones whose counts differ marked; the answer,
    held to the handout's sentences, leaves them to that page."""
    answer, details = render(tmp_path)
    lines = [line for line in details.split("**Per option**")[1].splitlines() if line.startswith("- ")]
    assert len(lines) == 3
    assert lines[0].startswith("- defaults: predicted all-gather 3.00, reduce-scatter 2.00 MB moved per step, "
                               "measured all-gather 3.00, reduce-scatter 2.00 MB;")
    assert "(differs)" not in lines[0] and "(differs)" in lines[2]
    assert "Per option" not in answer  # the per-option counts are the details page's: the answer keeps to its sentences


def test_without_results_the_page_says_how_to_run_it(tmp_path: Path):
    root = tmp_path / "results"
    (root / TAG).mkdir(parents=True)
    rendered = render_writeup(root, tmp_path / "out", pages=[fsdp_page, machines_page])
    assert "scripts/bench_fsdp_options.py --model-size tiny" in rendered.details[0].read_text()
