"""The writeup's "beyond the handout" sections: the sharding accounting, the doctor.

Results files are written here by code with the benchmarks' schema (the accounting with
``sharding_accounting``'s formulas) and planted values whose verdicts we know. The lever
ablation's section is tested in tests/test_writeup_ablation.py. Nothing spawns a process.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cs336_systems import doctor
from cs336_systems.run_metadata import write_results
from cs336_systems.sharding_accounting import (
    ShardingAccountingSetting,
    communication_bytes_per_rank,
    expected_adam_state_bytes,
)
from cs336_systems.sharding_accounting import setting_record as sharding_setting_record
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.beyond_sections import BEYOND_SECTIONS
from cs336_systems.writeup.sections import SECTIONS

from .test_writeup import CPU_TAG, environment, output_files

pytestmark = pytest.mark.problem("beyond")

MB = 2**20
# The accounting: B parameter bytes over N ranks, planted peaks above baseline per phase.
PARAM_BYTES, LARGEST, N_RANKS = 64 * MB, 8 * MB, 4
PEAKS = {"unsharded": {"after_init": 70 * MB, "before_step": 200 * MB, "after_step": 260 * MB},
         "sharded": {"after_init": 70 * MB, "before_step": 140 * MB, "after_step": 164 * MB}}
MEDIANS = {"unsharded": (0.400, 0.080), "sharded": (0.440, 0.050)}  # (step, optimizer step)


def sharding_record(configuration: str, rank: int, fresh_process: bool) -> dict:
    sharded = configuration == "sharded"
    state = expected_adam_state_bytes(PARAM_BYTES, N_RANKS, sharded)
    owned = PARAM_BYTES // N_RANKS if sharded else PARAM_BYTES
    comm = communication_bytes_per_rank(PARAM_BYTES, N_RANKS)

    def phase(name: str) -> dict:
        peak = PEAKS[configuration][name]
        parts = {"parameters": PARAM_BYTES, "gradients": 0 if name == "after_init" else PARAM_BYTES,
                 "optimizer_state": 0 if name == "after_init" else int(state) + 4 * 8}
        parts["other"] = peak - sum(parts.values())
        return {"peak_bytes": 500 * MB + peak, "current_bytes": 500 * MB + peak - MB,
                "peak_above_baseline_bytes": peak, "current_above_baseline_bytes": peak - MB, "breakdown": parts}

    step_s, opt_s = MEDIANS[configuration]
    return {
        "configuration": configuration, "rank": rank, "world_size": N_RANKS, "method": "rss", "peak_resettable": True,
        "fresh_process": fresh_process, "malloc_mmap_threshold_bytes": 131072, "baseline_bytes": 500 * MB,
        "phases": {p: phase(p) for p in ("after_init", "before_step", "after_step")},
        "first_step_phases": {p: phase(p) for p in ("before_step", "after_step")},
        "n_parameters": PARAM_BYTES // 4, "n_parameter_tensors": 8, "parameter_bytes": PARAM_BYTES,
        "largest_parameter_bytes": LARGEST, "owned_parameters": 2 if sharded else 8, "owned_parameter_bytes": owned,
        "measured_optimizer_state_bytes": int(state) + 4 * 8, "expected_optimizer_state_bytes": state,
        "expected_optimizer_state_imbalance_bound_bytes": 2 * LARGEST if sharded else 0,
        "communication_bytes_per_rank": {
            "gradient_allreduce": comm["ddp_allreduce"],
            "parameter_broadcast": comm["sharded_optimizer_broadcast"] if sharded else 0.0,
            "parameter_broadcast_received": float(PARAM_BYTES - owned) if sharded else 0.0,
        },
        "step_times_s": [step_s] * 3, "optimizer_step_times_s": [opt_s] * 3,
        "median_step_s": step_s, "median_optimizer_step_s": opt_s,
    }


def sharding_results(separate_launches: bool = True) -> tuple[list[dict], dict]:
    setting = ShardingAccountingSetting(model_size="tiny", context_length=32, world_size=N_RANKS)
    records = [sharding_record(c, rank, fresh_process=separate_launches or c == "unsharded")
               for c in ("unsharded", "sharded") for rank in range(N_RANKS)]
    meta = environment("cpu", "gloo", N_RANKS)
    meta.update(setting=sharding_setting_record(setting), n_parameters=PARAM_BYTES // 4, memory_method="rss",
                communication_bytes_per_rank=communication_bytes_per_rank(PARAM_BYTES, N_RANKS))
    return records, meta


def build_tree(root: Path, separate_launches: bool = True) -> Path:
    results = root / "results"
    write_results(results / CPU_TAG / "sharded_optimizer.json", *sharding_results(separate_launches))
    return results


def section(readme: str, heading_start: str) -> str:
    return readme.split(f"## {heading_start}")[1].split("\n## ")[0]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("beyond")
    results = build_tree(root)
    first = render_writeup(results, root / "a", sections=BEYOND_SECTIONS)
    render_writeup(results, root / "b", sections=BEYOND_SECTIONS)
    return {"root": root, "readme": first.readme.read_text()}


def test_beyond_sections_are_registered_last():
    assert SECTIONS[-len(BEYOND_SECTIONS):] == BEYOND_SECTIONS


def test_rendering_twice_gives_byte_identical_files(rendered):
    a, b = output_files(rendered["root"] / "a"), output_files(rendered["root"] / "b")
    assert sorted(a) == sorted(b) and any(name.startswith("figures/") for name in a)
    for name in a:
        assert a[name] == b[name], f"{name} differs between two renders of the same results"


def test_sharding_memory_state_and_time_come_from_the_records(rendered):
    text = section(rendered["readme"], "optimizer_state_sharding_accounting")
    assert "process RSS high-water mark" in text and "CUDA allocator" not in text
    assert "| unsharded | 0 | 70.0 | 200 | 260 | 500 |" in text
    assert "| sharded | 3 | 70.0 | 140 | 164 | 500 |" in text
    # Breakdown after the step: parameters 64, gradients 64, state 128 / 32 MB (+ 32 bytes of steps).
    other_sharded = (164 * MB - 64 * MB - 64 * MB - (32 * MB + 32)) / MB
    assert f"| sharded | 0 | 64.0 | 64.0 | 32.0 | {other_sharded:.2f} | 164 |" in text
    assert "| unsharded | 1 | 8 of 8 | 128 | 128 | 1.00× | – |" in text
    assert "| sharded | 2 | 2 of 8 | 32.0 | 32.0 | 1.00× | 16.0 |" in text
    assert "0.250× (1/n = 0.250 on 4 ranks" in text
    assert "164 MB sharded, 260 MB unsharded (96.0 MB lower with sharding)" in text
    assert "step 1.10× (440 vs 400 ms), `optimizer.step()` 0.625× (50.0 vs 80.0 ms)" in text
    assert "comparison is across launches" in text


def test_sharding_communication_is_computed_from_b_and_n(rendered):
    text = section(rendered["readme"], "optimizer_state_sharding_accounting")
    ddp = 2 * (N_RANKS - 1) / N_RANKS * PARAM_BYTES / MB  # 96 MB
    assert f"B = {PARAM_BYTES / MB:.1f} MB" in text and f"n = {N_RANKS} ranks" in text
    assert f"| DDP (gradient all-reduce) | 2(n−1)/n · B | {ddp:.1f} | 1× |" in text
    assert f"| {1.5 * ddp:.0f} | 1.50× |" in text
    assert text.count(f"| {ddp:.1f} | 1× |") == 2  # DDP and the paper's ZeRO-1 move the same bytes
    assert "Rajbhandari et al." in text


def test_one_launch_for_both_configurations_is_not_called_across_launches(tmp_path):
    results = build_tree(tmp_path, separate_launches=False)
    readme = render_writeup(results, tmp_path / "out", sections=BEYOND_SECTIONS[1:2]).readme.read_text()
    assert "across launches" not in readme and "step 1.10×" in readme


def test_missing_results_say_not_measured_with_the_command(tmp_path):
    readme = render_writeup(tmp_path / "none", tmp_path / "out", sections=BEYOND_SECTIONS).readme.read_text()
    for heading in ("optimizer_state_sharding_accounting",):
        text = section(readme, heading)
        assert "**not measured here**" in text and "`make bench`" in text and "`make bench-gpu`" in text
    assert not re.search(r"\d+\.\d+ ms", readme)


def test_doctor_section_lists_every_injectable_fault(rendered):
    text = section(rendered["readme"], "Beyond: make doctor")
    for fault in doctor.INJECTIONS:
        assert f'make doctor DOCTOR_ARGS="--inject {fault}' in text
    assert "exits 1" in text
