"""The writeup's optimizer_state_sharding page and answer, and the doctor page.

A ``sharded_optimizer.json`` is written here with the benchmark's own record class and writer,
holding planted values whose rendering we know: B = 64 MB of parameters on 4 ranks, a peak after
initialisation of twice the parameters, and step times over 8 interleaved rounds in which the
sharded step is 37-43 ms slower in every round (beyond the noise) while the sharded
``optimizer.step()`` is sometimes faster, sometimes slower (indistinguishable). All on top of a
machine load that drifts from round to round and hits both configurations of a round alike.
Expected numbers are computed here from the planted constants. Nothing spawns a process.
"""

from __future__ import annotations

import math
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
from cs336_systems.writeup.render import heading
from cs336_systems.writeup.pages import doctor_page
from cs336_systems.writeup.pages import machines_page
from cs336_systems.writeup.sharding_section import sharding_page

from .test_writeup import ANSWER_WORDS, prose_words, repeated_rows
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


def mb(n_bytes: float) -> str:
    """Bytes in MB to three significant digits, trailing zeros kept (as the writeup prints them)."""
    value = n_bytes / MB
    return "0" if value == 0 else f"{value:.{max(0, 2 - math.floor(math.log10(value)))}f}"


def render(root: Path, out: Path) -> dict:
    rendered = render_writeup(root, out, pages=[sharding_page, machines_page])
    readme = rendered.readme.read_text()
    return {"answer": readme.split(heading("optimizer_state_sharding_accounting") + "\n")[1].split("\n## ")[0],
            "details": rendered.details[0].read_text(), "machines": rendered.details[1].read_text(),
            "text": rendered.text(), "documents": [readme, *(p.read_text() for p in rendered.details)]}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sharding")
    results = build_tree(root / "results")
    first, second = render(results, root / "a"), render(results, root / "b")
    assert first["text"] == second["text"]
    return first


def peak(configuration: str, name: str) -> float:
    return phase(configuration, name).peak_above_baseline_bytes


def test_the_answer_table_holds_the_fullest_rank_at_each_point_the_handout_names(rendered):
    answer = rendered["answer"]
    for configuration in CONFIGURATIONS:
        held = phase(configuration, "after_step")
        cells = [held.parameters_bytes, held.gradients_bytes, held.optimizer_state_bytes,
                 *(peak(configuration, name) for name in ("after_init", "before_step", "after_step"))]
        assert f"| {configuration} | " + " | ".join(mb(c) for c in cells) + " |" in answer
    assert "after_model" not in answer and "RSS high-water mark" in answer


def test_the_answer_compares_memory_and_time_with_intervals(rendered):
    answer = rendered["answer"]
    state_u, state_s = (phase(c, "after_step").optimizer_state_bytes for c in ("unsharded", "sharded"))
    assert "both hold only the parameters (AdamW makes its state at its first step; peaks within 0 MB)" in answer
    assert "cuts the state to 0.250×" in answer and f"against {mb(state_u - state_s)} MB less" in answer
    drops = [mb(peak("unsharded", name) - peak("sharded", name)) for name in ("before_step", "after_step")]
    assert f"the peak by {drops[0]} MB before the step and {drops[1]} MB after it" in answer
    # Sharded minus unsharded per round: 37-43 ms every round (resolved); the optimizer step ±3 ms (not).
    assert "sharded − unsharded per round 40.0 ms (95% interval 37.0 to 43.0 ms), sharded slower" in answer
    assert "took 80.0 ms unsharded, 80.0 ms sharded (medians; sharded − unsharded per round 0.500 ms, " \
           "95% interval -3.00 to 4.00 ms, indistinguishable here)" in answer


def test_the_zero1_comparison_counts_memory_and_bytes_from_psi_and_n(rendered):
    answer = rendered["answer"]
    psi, n = PARAM_BYTES // 4, N_RANKS
    assert f"$2\\Psi + 2\\Psi + 12\\Psi/N_d$ per rank ({mb((4 + 12 / n) * psi)} MB here, " in answer
    assert f"$4\\Psi + 4\\Psi + 8\\Psi/N_d$ ({mb((8 + 8 / n) * psi)} MB; " in answer and "), and adds a parameter broadcast" in answer
    # and at the 2026 handout's xl (3,406,809,600 parameters), whatever model the run had
    assert f"{mb((4 + 12 / n) * 3_406_809_600)} MB at the 2026 handout's xl" in answer
    ddp = 2 * (n - 1) / n * PARAM_BYTES
    assert f"({mb(1.5 * ddp)} MB per rank and step, 1.50× DDP's {mb(ddp)} MB)" in answer
    assert "reduce-scatter and all-gather move what DDP moves" in answer
    for part in re.split(r"\*\*\([a-d]\)", answer):  # the handout's length per lettered part
        assert prose_words(part) <= ANSWER_WORDS


def test_the_details_show_every_rank_and_point_once(rendered):
    details = rendered["details"]
    assert "| sharded | 2 | after_step | 64.0 | 64.0 | 32.0 | 40.0 | 200 | 199 |" in details
    assert "| unsharded | 1 | after_model | 64.0 | 0 | 0 | 24.0 | 88.0 | 87.0 |" in details
    assert "| sharded | 2 | 2 of 8 | 32.0 | 32.0 | 1.00× | 16.0 |" in details
    assert "| unsharded | 8 | 400 | 397–403 | 80.0 |" in details
    assert "500 to 501 MB over configurations and ranks (a spread of 0.750 MB)" in details
    assert "No tensor was reachable from Python at any baseline" in details
    assert "2.00× the parameters" in details and "64.0 MB of transients" in details
    assert "rank 0 48.0 MB" in details and "differ by at most 0 MB" in details
    assert repeated_rows(rendered["documents"]) == []


def test_too_few_rounds_state_no_difference(tmp_path):
    answer = render(build_tree(tmp_path / "results", rounds=3), tmp_path / "out")["answer"]
    assert "(3 timed rounds: no interval, so no finding on speed)" in answer and "per round" not in answer
    assert "slower" not in answer and "indistinguishable" not in answer


def test_a_leaked_tensor_at_the_baseline_is_called_out(tmp_path):
    details = render(build_tree(tmp_path / "results", live=3 * MB), tmp_path / "out")["details"]
    assert "**Tensors were still reachable at a baseline** (3.00 MB)" in details


def test_missing_results_are_listed_once_on_the_machines_page(tmp_path):
    found = render(tmp_path / "none", tmp_path / "out")
    assert "Not measured here" in found["answer"] and "machines.md#not-measured-here" in found["answer"]
    assert found["machines"].count("optimizer state sharding accounting") == 2  # gloo on CPU, NCCL on GPUs
    assert "`make bench`" in found["machines"] and "`make bench-gpu`" in found["machines"]
    assert not re.search(r"\d+\.\d+ ms", found["text"])


def test_the_doctor_page_names_the_layout_and_every_injectable_fault(tmp_path):
    text = render_writeup(tmp_path / "none", tmp_path / "out", pages=[doctor_page]).details[0].read_text()
    assert text.startswith("# Beyond the handout: make doctor")
    for fault in INJECTIONS:
        assert f'make doctor DOCTOR_ARGS="--inject {fault}' in text
    assert "`cs336_systems/doctor/`" in text and "`--out PATH`" in text and "exits 1" in text
    assert "`cs336_systems/ddp/auto_bucket.py`" in text
