"""The writeup's FSDP section, from small results files written with the benchmark's own writer.

Each test plants a run whose reading is known (torch's FSDP slower in every round, or the two
FSDPs alternating, or ours slower; memory and bytes chosen by hand; a traced step whose
all-gathers half overlap compute) and checks the sentences, the table cells and the timeline
figure the section draws from them. Nothing spawns a process.
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
from cs336_systems.writeup.context import RenderContext
from cs336_systems.writeup.fsdp_section import fsdp_section
from cs336_systems.writeup.load import load_results

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


def render(tmp_path: Path, torch_minus_ours_s: list[float] | None) -> tuple[str, list[Path]]:
    root = tmp_path / "results"
    if torch_minus_ours_s is not None:
        write_results(results_path(FsdpStepRecord.KIND, TAG, root=root),
                      ResultsFile(FsdpStepRecord.KIND, environment(), to_json(SETTING), records(torch_minus_ours_s)))
    else:
        (root / TAG).mkdir(parents=True)
    section = fsdp_section(RenderContext(load_results(root), tmp_path / "out"))
    return section.markdown, section.figures


TIME, MEMORY_TABLE, BYTES = 0, 1, 2  # the section's tables, in order


def row(markdown: str, first_cell: str, table: int = TIME) -> list[str]:
    """The cells of the row starting with ``first_cell`` in the section's ``table``-th table."""
    lines = [line for line in markdown.splitlines() if line.startswith(f"| {first_cell} |")]
    return [c.strip() for c in lines[table].strip("|").split("|")]


def test_torch_slower_every_round_meets_the_goal_and_every_table_shows_the_run(tmp_path):
    markdown, figures = render(tmp_path, [0.2] * ROUNDS)
    assert "Our FSDP timed in its reduce-scatter mode." in markdown
    assert "torch's FSDP's step is 200 ms longer than our FSDP's" in markdown
    assert "the goal is met for step time" in markdown
    assert "30.0 MB ours against 33.0 MB torch's (9.09% lower); the goal is met for memory" in markdown
    assert row(markdown, "torch's FSDP")[4:7] == ["+200", "200 to 200", "torch's FSDP slower"]
    assert row(markdown, "DDP")[4:7] == ["-500", "-500 to -500", "DDP faster"]
    assert row(markdown, "ZeRO-1")[6] == "indistinguishable here"  # ±100 ms alternating
    # Memory: 16 + 16 + 24 MB over 4 Mi parameters is 14 bytes each; (1024 - 8) MB / 14 B is 76.1 M,
    # under the handout's small model (128 M): the largest of the table is cpu-small (22.7 M).
    assert row(markdown, "DDP", MEMORY_TABLE) == ["DDP", "64.0", "16.0", "16.0", "24.0", "8.00", "56.0", "14.0",
                                        "76.1 M (cpu-small)"]
    # Bytes: our FSDP sends (28 + 16) / 2 MB; the formula 3 x 16 / 2 MB; DDP 2 x 16 / 2 MB.
    assert row(markdown, "our FSDP", BYTES)[1:] == ["28.0 (3)", "16.0 (3)", "–", "–", "22.0", "24.0", "0.917×", "1.38×"]
    assert "the rank waited for communication 100 ms of the 4000 ms step" in markdown
    assert "it computed during 50.0% of the time an all-gather was open (2 all-gathers)" in markdown
    assert "0 of 1 reduce-scatters were launched while backward was still running" not in markdown
    assert "1 of 1 reduce-scatters were launched while backward was still running" in markdown
    assert len(figures) == 1 and figures[0].is_file() and figures[0].name == f"{TAG}_fsdp_step_timeline.png"
    assert "NCCL on GPUs (`nccl`): **not measured here**; `make bench-gpu`" in markdown
    assert "gloo on CPU (`gloo`): **not measured here**" not in markdown


def test_a_difference_whose_interval_holds_zero_is_indistinguishable(tmp_path):
    markdown, _ = render(tmp_path, [0.05 if i % 2 else -0.05 for i in range(ROUNDS)])
    assert "torch's FSDP and our FSDP are indistinguishable here" in markdown
    assert "met for step time only in the sense that the two are indistinguishable here" in markdown


def test_ours_slower_says_by_how_much_with_the_interval(tmp_path):
    markdown, _ = render(tmp_path, [-0.3 - 0.01 * i for i in range(ROUNDS)])
    assert "**not met for step time**: ours is 335 ms per step slower (95% interval 300 to 370 ms)" in markdown


def test_without_results_every_setting_is_not_measured_with_its_command(tmp_path):
    markdown, figures = render(tmp_path, None)
    assert figures == []
    assert "gloo on CPU (`gloo`): **not measured here**; `make bench`" in markdown
    assert "NCCL on GPUs (`nccl`): **not measured here**; `make bench-gpu`" in markdown
    assert "python scripts/bench_fsdp.py" in markdown
    assert "**When to pick which.**" in markdown and "**Two modes.**" in markdown
