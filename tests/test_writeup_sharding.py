"""The writeup's sharding-accounting and doctor sections.

A ``sharded_optimizer.json`` is written here with the benchmark's own record class and writer,
holding planted values whose rendering we know: B = 64 MB of parameters on 4 ranks, a peak after
initialisation of twice the parameters, and step times over 8 interleaved rounds in which the
sharded step is 37-43 ms slower in every round (beyond the noise) while the sharded
``optimizer.step()`` is sometimes faster, sometimes slower (indistinguishable). All on top of a
machine load that drifts from round to round and hits both configurations of a round alike.
Nothing spawns a process.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cs336_systems.bench.accounting import (
    CONFIGURATIONS,
    AccountingRecord,
    AccountingSetting,
    PhaseMemory,
    expected_adam_state_bytes,
)
from cs336_systems.doctor import INJECTIONS
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import results_path
from cs336_systems.results.schema import to_json
from cs336_systems.units import MB
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.doctor_section import doctor_section
from cs336_systems.writeup.sharding_section import sharding_accounting_section

from .test_writeup_allreduce import environment

pytestmark = pytest.mark.problem("beyond")

TAG = "cpu2-test-xeon"
PARAM_BYTES, LARGEST, N_RANKS, N_TENSORS = 64 * MB, 8 * MB, 4, 8
STEP_BYTES = 4  # AdamW's float32 step counter per parameter tensor
BASELINE = 500 * MB
# Peaks above the baseline per point, and the bytes beyond parameters, gradients and state.
OTHER = {"after_model": 24 * MB, "after_init": 64 * MB, "before_step": 8 * MB, "after_step": 40 * MB}
DRIFT_S = [0.000, 0.002, -0.002, 0.001, -0.001, 0.000, 0.003, -0.003]  # machine load per round
STEP_EXTRA_S = [0.040, 0.041, 0.039, 0.042, 0.038, 0.040, 0.043, 0.037]  # sharded minus unsharded
OPT_EXTRA_S = [-0.003, 0.002, 0.001, -0.001, 0.004, -0.002, 0.000, 0.003]  # median +0.5 ms, both signs


def phase(configuration: str, name: str) -> PhaseMemory:
    sharded = configuration == "sharded"
    stepped = name in ("before_step", "after_step")
    state = int(expected_adam_state_bytes(PARAM_BYTES, N_RANKS, sharded)) + STEP_BYTES * (2 if sharded else 8)
    counted = {"parameters_bytes": PARAM_BYTES, "gradients_bytes": PARAM_BYTES if stepped else 0,
               "optimizer_state_bytes": state if stepped else 0}
    peak = sum(counted.values()) + OTHER[name]
    return PhaseMemory(peak_above_baseline_bytes=peak, current_above_baseline_bytes=peak - MB,
                       other_bytes=OTHER[name], **counted)


def record(configuration: str, rank: int, rounds: int, live: int) -> AccountingRecord:
    sharded = configuration == "sharded"
    owned = PARAM_BYTES // N_RANKS if sharded else PARAM_BYTES
    steps = [0.400 + d + (e if sharded else 0.0) for d, e in zip(DRIFT_S, STEP_EXTRA_S)][:rounds]
    optimizer_steps = [0.080 + d + (e if sharded else 0.0) for d, e in zip(DRIFT_S, OPT_EXTRA_S)][:rounds]
    return AccountingRecord(
        configuration=configuration, rank=rank, world_size=N_RANKS, method="rss", peak_resettable=True,
        malloc_mmap_threshold_bytes=131072, baseline_bytes=BASELINE + rank * MB // 4, baseline_live_tensor_bytes=live,
        **{name: phase(configuration, name) for name in ("after_model", "after_init", "before_step", "after_step")},
        n_parameters=PARAM_BYTES // 4, n_parameter_tensors=N_TENSORS, parameter_bytes=PARAM_BYTES,
        largest_parameter_bytes=LARGEST, owned_parameters=2 if sharded else N_TENSORS, owned_parameter_bytes=owned,
        optimizer_state_bytes=phase(configuration, "after_step").optimizer_state_bytes,
        expected_optimizer_state_bytes=expected_adam_state_bytes(PARAM_BYTES, N_RANKS, sharded),
        optimizer_state_imbalance_bound_bytes=2 * LARGEST if sharded else 0,
        broadcast_received_bytes=PARAM_BYTES - owned if sharded else 0,
        step_times_s=steps, optimizer_step_times_s=optimizer_steps,
    )


def build_tree(root: Path, rounds: int = 8, live: int = 0) -> Path:
    setting = AccountingSetting(model_size="tiny", context_length=32, global_batch=8, world_size=N_RANKS, steps=rounds)
    records = [record(c, rank, rounds, live) for c in CONFIGURATIONS for rank in range(N_RANKS)]
    results = ResultsFile(AccountingRecord.KIND, environment("cpu", "gloo", N_RANKS), to_json(setting), records)
    write_results(results_path(AccountingRecord.KIND, TAG, root=root), results)
    return root


def section(readme: str, heading_start: str) -> str:
    return readme.split(f"## {heading_start}")[1].split("\n## ")[0]


def render(root: Path, out: Path) -> str:
    return render_writeup(root, out, sections=[sharding_accounting_section, doctor_section]).text()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sharding")
    results = build_tree(root / "results")
    first = render(results, root / "a")
    second = render(results, root / "b")
    return {"readme": first, "again": second, "text": section(first, "optimizer_state_sharding_accounting")}


def test_rendering_twice_gives_the_same_text(rendered):
    assert rendered["readme"] == rendered["again"]


def test_memory_at_each_point_comes_from_the_records(rendered):
    text = rendered["text"]
    assert "process RSS high-water mark" in text and "CUDA allocator" not in text
    # Peaks: model 64 + 24, init 64 + 64, before 64 + 64 + state + 8, after 64 + 64 + state + 40 (MB).
    assert "| unsharded | 0 | 500 | 88.0 | 128 | 264 | 296 |" in text
    assert "| sharded | 3 | 501 | 88.0 | 128 | 168 | 200 |" in text
    assert "| sharded | 2 | after_step | 64.0 | 64.0 | 32.0 | 40.0 | 200 | 199 |" in text
    assert "| unsharded | 1 | after_init | 64.0 | 0 | 0 | 64.0 | 128 | 127 |" in text
    assert "500 to 501 MB over configurations and ranks (a spread of 0.750 MB" in text
    assert "No tensor was reachable from Python at any baseline" in text


def test_the_peak_after_initialisation_is_explained(rendered):
    text = rendered["text"]
    assert "Why the peak after initialisation is 2.00× the parameters (128 MB against 64.0 MB" in text
    assert "besides the parameters it holds 64.0 MB of transients" in text
    assert "min(B, 64.0 MB) = 64.0 MB exists beside the parameters at once" in text and "`trunc_normal_`" in text
    assert "peaked lower: 24.0 MB above its parameters" in text


def test_state_and_peaks_compare_the_configurations(rendered):
    text = rendered["text"]
    assert "| unsharded | 1 | 8 of 8 | 128 | 128 | 1.00× | – |" in text
    assert "| sharded | 2 | 2 of 8 | 32.0 | 32.0 | 1.00× | 16.0 |" in text
    assert "0.250× (1/n = 0.250 on 4 ranks" in text
    assert "their peaks there differ by at most 0 MB" in text
    assert "200 MB sharded, 296 MB unsharded (96.0 MB lower with sharding, against 96.0 MB less" in text


def test_time_differences_are_stated_with_their_interval(rendered):
    text = rendered["text"]
    assert "| unsharded | 8 | 400 | 397–403 | 80.0 |" in text
    assert "whole step: 40.0 ms (95% interval 37.0 to 43.0 ms): sharded slower" in text
    assert "`optimizer.step()`: 0.500 ms (95% interval -3.00 to 4.00 ms): indistinguishable here" in text
    assert "across launches" not in text


def test_too_few_rounds_state_no_difference(tmp_path):
    text = render(build_tree(tmp_path / "results", rounds=3), tmp_path / "out")
    assert "over 3 rounds, too few for a 95% interval (6 needed): no difference is stated" in text
    assert "slower" not in text and "indistinguishable" not in text


def test_a_leaked_tensor_at_the_baseline_is_called_out(tmp_path):
    text = render(build_tree(tmp_path / "results", live=3 * MB), tmp_path / "out")
    assert "**Tensors were still reachable at a baseline** (3.00 MB)" in text


def test_communication_is_computed_from_b_and_n(rendered):
    text = rendered["text"]
    ddp = 2 * (N_RANKS - 1) / N_RANKS * PARAM_BYTES / MB  # 96 MB
    assert f"B = {PARAM_BYTES / MB:.1f} MB" in text and f"n = {N_RANKS} ranks" in text
    assert f"| DDP (gradient all-reduce) | 2(n−1)/n · B | {ddp:.1f} | 1.00× |" in text
    assert f"| {1.5 * ddp:.0f} | 1.50× |" in text
    assert text.count(f"| {ddp:.1f} | 1.00× |") == 2  # DDP and the paper's ZeRO-1 move the same bytes
    assert "rank 0 48.0 MB" in text and "Rajbhandari et al." in text


def test_missing_results_say_not_measured_with_the_command(tmp_path):
    readme = render(tmp_path / "none", tmp_path / "out")
    text = section(readme, "optimizer_state_sharding_accounting")
    assert "**not measured here**" in text and "`make bench`" in text and "`make bench-gpu`" in text
    assert not re.search(r"\d+\.\d+ ms", readme)


def test_doctor_section_names_the_layout_and_every_injectable_fault(rendered):
    text = section(rendered["readme"], "Beyond: make doctor")
    for fault in INJECTIONS:
        assert f'make doctor DOCTOR_ARGS="--inject {fault}' in text
    assert "`cs336_systems/doctor/`" in text and "`--out PATH`" in text and "exits 1" in text
    assert "`cs336_systems/ddp/auto_bucket.py`" in text
