"""The writeup's fsdp page and fsdp_accounting answer, from small results files written with the benchmark's writer.

Each test plants a run whose reading is known (torch's FSDP slower in every round, or the two
FSDPs alternating, or ours slower; memory and bytes chosen by hand; a traced step whose
all-gathers half overlap compute) and checks the sentences, the table cells and the timeline
figure the page draws from them. Nothing spawns a process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cs336_systems.bench.fsdp.configurations import CONFIGURATIONS
from cs336_systems.bench.fsdp.formulas import DDP, FSDP, TORCH_FSDP, ZERO1
from cs336_systems.bench.fsdp.record import FsdpStepRecord, FsdpTimeline
from cs336_systems.bench.fsdp.setting import FsdpSetting
from cs336_systems.bench.fsdp.summarize import Measured, summarize
from cs336_systems.results.environment import Environment
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import results_path
from cs336_systems.results.schema import to_json
from cs336_systems.units import MB
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.render import heading
from cs336_systems.writeup.fsdp_section import fsdp_page
from cs336_systems.writeup.pages import machines_page

from .test_writeup import repeated_rows
from .test_writeup_allreduce import quiet

pytestmark = pytest.mark.problem("fsdp")
TAG = "cpu2-test-epyc"
ROUNDS = 8
SETTING = FsdpSetting(model_size="tiny", context_length=32, global_batch=4, rounds=ROUNDS)
# Peak and its parts (parameters, gradients, optimizer state, activations), between steps, no allocator.
MEMORY = {
    DDP: [64 * MB, 16 * MB, 16 * MB, 24 * MB, 8 * MB, 56 * MB, -1],
    ZERO1: [52 * MB, 16 * MB, 16 * MB, 12 * MB, 8 * MB, 44 * MB, -1],
    FSDP: [30 * MB, 9 * MB, 1 * MB, 12 * MB, 8 * MB, 20 * MB, -1],
    TORCH_FSDP: [33 * MB, 10 * MB, 2 * MB, 12 * MB, 9 * MB, 22 * MB, -1],
}
B = 16 * MB  # parameter bytes
PAYLOADS = {
    DDP: {"all_reduce": B},
    ZERO1: {"all_reduce": B, "broadcast": B},
    FSDP: {"all_gather": 2 * B - 4 * MB, "reduce_scatter": B},
    TORCH_FSDP: {"all_gather": 1.5 * B, "reduce_scatter": B},
}
# A traced step: all-gathers open [0, 1] and [2, 3] s, compute [0.5, 2.5]: half of their time overlapped.
TIMELINE = FsdpTimeline(
    duration_s=4.0, phases={"forward": [0.0, 1.5], "backward": [1.5, 3.5], "finish": [3.5, 3.6],
                            "optimizer_step": [3.6, 4.0]},
    compute=[[0.5, 2.5]], collectives={"all_gather": [[0.0, 1.0], [2.0, 3.0]], "reduce_scatter": [[2.0, 3.8]]},
    waits=[[3.5, 3.6]], timed_median_s=3.0,
)


def environment() -> Environment:
    return Environment(
        hostname="testhost", platform="Linux-test", python_version="3.11.0", torch_version="2.99.0",
        cuda_version=None, nccl_version=None, cpu_model="Test EPYC", cpu_count=2, gpu_name=None, gpu_count=0,
        backend="gloo", world_size=2, device_type="cpu", shared_gpu=False, machine_tag="ignored",
        git_commit="abcdef0123456789abcdef0123456789abcdef01", git_dirty=False, timestamp_utc="2031-01-02T03:04:05+00:00",
        load=quiet(),
    )


def records(torch_minus_ours_s: list[float]) -> list[FsdpStepRecord]:
    """The benchmark's records for planted measurements: ours 1 s per step, DDP 0.5 s less every
    round, ZeRO-1 alternating ±0.1 s, torch's FSDP ours + the given difference per round."""
    ours = [1.0 + 0.01 * i for i in range(ROUNDS)]
    times = {
        FSDP: ours,
        DDP: [t - 0.5 for t in ours],
        ZERO1: [t + (0.1 if i % 2 else -0.1) for i, t in enumerate(ours)],
        TORCH_FSDP: [t + d for t, d in zip(ours, torch_minus_ours_s)],
    }
    measured = {n: Measured(times[n], MEMORY[n], PAYLOADS[n], {k: 3 for k in PAYLOADS[n]},
                            "reduce-scatter" if n == FSDP else None) for n in CONFIGURATIONS}
    return summarize(measured, {FSDP: TIMELINE, TORCH_FSDP: TIMELINE}, SETTING, n_parameters=B // 4, parameter_bytes=B,
                     free_per_rank=1024 * MB, world_size=2)


def render(tmp_path: Path, torch_minus_ours_s: list[float] | None) -> dict:
    root = tmp_path / "results"
    if torch_minus_ours_s is not None:
        write_results(results_path(FsdpStepRecord.KIND, TAG, root=root),
                      ResultsFile(FsdpStepRecord.KIND, environment(), to_json(SETTING), records(torch_minus_ours_s)))
    else:
        (root / TAG).mkdir(parents=True)
    rendered = render_writeup(root, tmp_path / "out", pages=[fsdp_page, machines_page])
    readme = rendered.readme.read_text()
    return {"answer": readme.split(heading("fsdp_accounting") + "\n")[1].split("\n## ")[0], "figures": rendered.figures,
            "details": rendered.details[0].read_text(), "machines": rendered.details[1].read_text(),
            "documents": [readme, *(p.read_text() for p in rendered.details)]}


PEAKS, TIME, BYTES = 0, 1, 2  # the details page's tables, in order


def row(markdown: str, first_cell: str, table: int = 0) -> list[str]:
    """The cells of the row starting with ``first_cell`` in the ``table``-th table holding such a row."""
    lines = [line for line in markdown.splitlines() if line.startswith(f"| {first_cell} |")]
    return [c.strip() for c in lines[table].strip("|").split("|")]


def test_torch_slower_every_round_meets_the_goal_and_every_table_shows_the_run(tmp_path):
    found = render(tmp_path, [0.2] * ROUNDS)
    details, answer = found["details"], found["answer"]
    assert "Our FSDP timed in its reduce-scatter mode." in details
    assert "Step time: met: torch's step is 200 ms longer (95% interval 200 to 200 ms)" in details
    assert "30.0 MB ours against 33.0 MB torch's: met" in details
    assert row(details, "torch's FSDP", TIME)[4:7] == ["+200", "200 to 200", "torch's FSDP slower"]
    assert row(details, "DDP", TIME)[4:7] == ["-500", "-500 to -500", "DDP faster"]
    assert row(details, "sharded optimizer", TIME)[6] == "indistinguishable here"  # ±100 ms alternating
    # Memory: 16 + 16 + 24 MB over 4 Mi parameters is 14 bytes each.
    assert row(details, "DDP", PEAKS) == ["DDP", "64.0", "16.0", "16.0", "24.0", "8.00", "56.0", "14.0"]
    # Bytes: our FSDP sends (28 + 16) / 2 MB; the formula 3 x 16 / 2 MB; DDP 2 x 16 / 2 MB.
    assert row(details, "our FSDP", BYTES)[1:] == ["28.0 (3)", "16.0 (3)", "–", "–", "22.0", "24.0", "0.917×", "1.38×"]
    assert "the rank waited for communication 100 ms of the 4000 ms step" in details
    assert "computed during 50.0% of the time an all-gather was open (2 all-gathers)" in details
    assert "1 of 1 reduce-scatters were launched while backward was still running" in details
    # (a) by the accounting at the 2026 handout's xl, whose problem it is (d_model 2560, d_ff 10240, 32 layers,
    # 32 heads: 3,406,809,600 parameters; capacity's 16 bytes per parameter, 16Ψ/2 = 25992 MB saved), then
    # this run: Ψ = 4 Mi parameters, n = 2, (1 − 1/n)·16Ψ = 32 MB against DDP and (1 − 1/n)·8Ψ = 16 MB
    # against the sharded optimizer ("ZeRO-1" is kept for the paper's stage 1); 34 and 22 MB measured.
    assert "at the 2026 handout's xl ($d_{model}$ = 2560, 32 layers: Ψ = 3.41B, n = 2)" in answer
    assert "should save **25992 MB**" in answer and "1998M" not in answer and "15245" not in answer
    assert "the peak falls by 34.0 MB against DDP and 22.0 MB against the sharded optimizer, 1.06× of the " \
           "accounting's 32.0 MB and 1.38× of the accounting's 16.0 MB" in answer and "ZeRO-1" not in answer
    assert "34.0 MB saved against the accounting's 32.0 MB (6.25% beyond it)" in details
    assert "held parameters" not in answer  # no part-by-part split of two peaks taken at different moments
    # (b) leads with its answer: the only wait, [3.5, 3.6] s, lies after forward [0, 1.5] s.
    assert "**(b)** **Yes**: in one traced step our FSDP's forward waited 0 ms of its 1500 ms" in answer
    # Forward's own all-gather ([0, 1] s, computing from 0.5 s) apart from the step's two.
    assert "waited 0 ms of its 1500 ms, for none of its 1 all-gathers." in answer
    figures = found["figures"]
    assert len(figures) == 1 and figures[0].is_file() and figures[0].name == f"{TAG}_fsdp_step_timeline.png"
    assert f"figures/{figures[0].name}" in answer
    assert "FSDP step benchmark" in found["machines"].split("NCCL on GPUs")[1]
    assert "FSDP step benchmark" not in found["machines"].split("NCCL on GPUs")[0]
    assert repeated_rows(found["documents"]) == []
    assert len(answer.split()) <= 400


def test_a_difference_whose_interval_holds_zero_is_indistinguishable(tmp_path):
    details = render(tmp_path, [0.05 if i % 2 else -0.05 for i in range(ROUNDS)])["details"]
    assert "met only in the sense that the two are indistinguishable here" in details


def test_ours_slower_says_by_how_much_with_the_interval(tmp_path):
    details = render(tmp_path, [-0.3 - 0.01 * i for i in range(ROUNDS)])["details"]
    assert "**not met**: ours is 335 ms per step slower (95% interval 300 to 370 ms)" in details


def test_without_results_every_setting_is_listed_once_on_the_machines_page(tmp_path):
    found = render(tmp_path, None)
    assert found["figures"] == []
    assert "Not measured here" in found["answer"] and "machines.md#not-measured-here" in found["answer"]
    assert found["machines"].count("FSDP step benchmark") == 2
    assert "python scripts/bench_fsdp.py" in found["details"]
    assert "**When to pick which.**" in found["details"] and "**Two modes.**" in found["details"]


def test_the_2026_accounting_uses_the_2026_handouts_xl():
    """The 2026 handout's Table 1 gives xl as d_model 2560, d_ff 10240, 32 layers, 32 heads (the 2025
    handout's xl is 1600, 6400, 48, 25): fsdp_accounting, a 2026 problem, accounts that one."""
    from cs336_basics.model import EDITION_MODEL_SIZES, MODEL_SIZES, expected_parameter_count
    from cs336_systems.writeup.fsdp_section import handout_expectation

    xl = EDITION_MODEL_SIZES["2026"]["xl"]
    assert (xl.d_model, xl.d_ff, xl.num_layers, xl.num_heads) == (2560, 10240, 32, 32)
    assert MODEL_SIZES["xl"].d_model == 1600 and EDITION_MODEL_SIZES["2025"]["xl"] is MODEL_SIZES["xl"]
    found = handout_expectation(2)
    assert found["psi"] == expected_parameter_count(xl) == 3_406_809_600
    assert round(found["saving"] / MB) == 25992  # 16Ψ/2 bytes: the peak FSDP saves against DDP at 2 ranks


def test_fsdp_accounting_b_reads_the_trace_gather_by_gather():
    """Issue 59: the answer said a bold "No" where only the first two of six all-gathers kept forward
    waiting. Each forward all-gather is judged by the waits inside its own interval."""
    from cs336_systems.bench.fsdp.record import FsdpTimeline
    from cs336_systems.writeup.fsdp_section import _timeline

    gathers = [[0.000, 0.014], [0.016, 0.019], [0.030, 0.040], [0.050, 0.060]]
    waits = [[0.001, 0.014], [0.0165, 0.019], [0.045, 0.045]]  # the last: a completed gather's instant wait
    timeline = FsdpTimeline(duration_s=0.2, phases={"forward": [0.0, 0.1], "backward": [0.1, 0.2]},
                            compute=[[0.014, 0.016], [0.019, 0.1]], collectives={"all_gather": gathers},
                            waits=waits, timed_median_s=0.2)
    found = _timeline("our FSDP", timeline)
    assert found["forward_gathers"] == 4
    assert [(i, round(w, 4)) for i, w in found["waited"]] == [(1, 0.013), (2, 0.0025)]
