"""The writeup's lever-ablation section, from a ``ddp_step-ablation.json`` written with the benchmark's writer.

Records are built by the benchmark's own ``summarize`` from planted step times whose verdicts we
know: a bucketed overhead 0.8x torch DDP's (goal holds), per-parameter 1.5x (goal fails), one
lever whose per-round difference from the default changes sign from round to round (within
noise) and one whose difference is the same in every round (beyond it), all on top of a machine
load that drifts from round to round and hits every variant of a round alike. Nothing spawns a
process.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cs336_systems.bench.step import ABLATION_VARIANTS, COMPUTE_ONLY, TORCH_DDP, RawVariant, StepRecord, StepSetting
from cs336_systems.bench.step import summarize
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import results_path
from cs336_systems.results.schema import to_json
from cs336_systems.units import MB
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.ablation_section import ablation_section

from .test_writeup_allreduce import environment
from .test_writeup_ddp import output_files

pytestmark = pytest.mark.problem("beyond")

TAG = "cpu2-test-xeon"
ROUNDS = 8  # the fewest for which the 95% sign-test interval exists as min..max (n >= 6)
DRIFT_S = [0.000, 0.002, -0.002, 0.001, -0.001, 0.000, 0.003, -0.003]  # machine load per round
# Copy's own round-to-round deviation: median 0, so its overhead is 18 ms, 2 ms above the
# default's, but one round is 1 ms faster than the default: within noise.
COPY_EXTRA_S = [0.000, 0.000, -0.003, 0.002, 0.000, 0.001, -0.002, 0.000]
# Step per variant before drift, so exposed overhead = step - 100 ms in every round.
STEP_S = {
    "per-parameter": 0.130,  # 30 ms: 1.5x torch's 20 ms, goal (<= 1.2x) fails
    "bucketed-25MB-plain": 0.128,
    "bucketed-25MB-copy": 0.118,  # 2 ms above the default, give or take COPY_EXTRA_S: within noise
    "bucketed-25MB-no-first": 0.125,  # 9 ms above the default in every round: beyond the noise
    "bucketed-25MB-no-reorder": 0.117,
    "bucketed-25MB": 0.116,  # 16 ms: 0.8x torch's, goal (<= 0.9x) holds
    "bucketed-25MB-bf16": 0.112,  # 12 ms: the lowest bucketed overhead, 0.6x torch's
    "bucketed-auto": 0.119,
    "torch-ddp": 0.120,  # 20 ms
}
AUTO_CAP_BYTES = 3 * MB
SECTIONS = [ablation_section]


def ablation_records(torch_step_s: float = STEP_S[TORCH_DDP]) -> list[StepRecord]:
    steps = {**STEP_S, TORCH_DDP: torch_step_s}
    raw = []
    for name in ABLATION_VARIANTS:
        bucketed = name.startswith("bucketed-")
        raw.append(RawVariant(
            variant=name,
            step_times_s=[steps.get(name, 0.100) + d + (name == "bucketed-25MB-copy") * extra
                          for d, extra in zip(DRIFT_S, COPY_EXTRA_S)],
            sync_times_s=None if name in (COMPUTE_ONLY, TORCH_DDP) else [0.005] * ROUNDS,
            allreduce_calls_per_step=None if name == COMPUTE_ONLY else 2,
            n_buckets=2 if bucketed or name == TORCH_DDP else None,
            bucket_cap_bytes=(AUTO_CAP_BYTES if name == "bucketed-auto" else 25 * MB) if bucketed else None,
        ))
    return summarize(raw, tokens_per_step=4 * 32)


def write_ablation(root: Path, torch_step_s: float = STEP_S[TORCH_DDP]) -> Path:
    setting = StepSetting(model_size="tiny", context_length=32, global_batch=4, rounds=ROUNDS, steps_per_round=1,
                          ablation=True)
    results = ResultsFile(StepRecord.KIND, environment(), to_json(setting), ablation_records(torch_step_s),
                          {"n_parameters": 1362240})
    return write_results(results_path(StepRecord.KIND, TAG, suffix=setting.tag_suffix, root=root), results)


def render(tmp_path: Path, out: str = "out", **kwargs) -> str:
    root = tmp_path / "results"
    write_ablation(root, **kwargs)
    return render_writeup(root, tmp_path / out, sections=SECTIONS).readme.read_text()


@pytest.fixture(scope="module")
def readme(tmp_path_factory) -> str:
    return render(tmp_path_factory.mktemp("ablation"))


def test_the_ablation_file_is_a_ddp_step_run(tmp_path):
    path = write_ablation(tmp_path)
    assert path.name == "ddp_step-ablation.json" and path.parent.name == TAG


def test_rendering_twice_gives_byte_identical_files(tmp_path):
    render(tmp_path, "a")
    render(tmp_path, "b")
    a, b = output_files(tmp_path / "a"), output_files(tmp_path / "b")
    assert a == b and any(name.startswith("figures/") for name in a)


def test_ablation_table_and_goals_are_computed_from_the_records(readme):
    text = readme
    # Row: buckets, cap, median step, spread, exposed overhead, ratio to torch's 20 ms.
    row = ("| bucketed-25MB | 25 MB buckets, every lever on (the default) | 2 | 25 | 116 | 113–119 | 16.0 "
           "| 16.0 to 16.0 | 0.800× |")
    assert row in text
    assert "| bucketed-auto |" in text and "| 3 | 119 |" in text  # the chosen cap, in MB
    assert "| compute-only |" in text and "97.0–103" in text
    assert "| bucketed-25MB-copy |" in text and "| 18.0 | 15.0 to 20.0 |" in text
    assert "bucketed-25MB's exposed overhead ≤ 0.9× torch DDP's: **holds** in this run (0.800×" in text
    assert "per-parameter's exposed overhead ≤ 1.2× torch DDP's: **does not hold** in this run (1.50×" in text
    assert "Lowest exposed overhead of the bucketed variants: bucketed-25MB-bf16, 12.0 ms, 0.600× torch DDP's" in text
    assert "6.00 ms (max − min of its 8 timed steps)" in text
    assert "gradient views off (bucketed-25MB-copy): +2.00 ms (within noise: 95% interval -1.00 to 4.00 ms)" in text
    assert "small first bucket off (bucketed-25MB-no-first): +9.00 ms (beyond the noise: 95% interval" in text
    assert "its step minus torch DDP's, round by round, is -4.00 ms (beyond the noise" in text
    assert "tests/test_ddp_equivalence.py" in text
    assert "### Machine `cpu2-test-xeon` · `ddp_step-ablation.json`" in text
    assert "8 timed steps per variant in 8 interleaved rounds" in text
    assert re.search(r"!\[[^\]]*\]\(figures/[^)]*ablation_exposed_overhead\.png\)", text)


def test_goals_are_not_judged_when_torch_ddp_shows_no_overhead(tmp_path):
    readme = render(tmp_path, torch_step_s=0.099)  # faster than the compute-only median
    assert "ratios to it are undefined and the goals cannot be judged" in readme
    assert "holds" not in readme
    assert "Lowest exposed overhead of the bucketed variants: bucketed-25MB-bf16, 12.0 ms." in readme


def test_the_main_ddp_step_run_is_not_read_as_an_ablation(tmp_path):
    root = tmp_path / "results"
    records = [r for r in ablation_records() if r.variant in (COMPUTE_ONLY, "per-parameter")]
    write_results(results_path(StepRecord.KIND, TAG, root=root),
                  ResultsFile(StepRecord.KIND, environment(), to_json(StepSetting()), records))
    readme = render_writeup(root, tmp_path / "out", sections=SECTIONS).readme.read_text()
    assert "### Machine" not in readme  # no ablation run, so nothing measured
    assert "Lever ablation (`scripts/bench_ddp.py --ablation`), gloo on CPU (`gloo`): **not measured here**" in readme


def test_missing_results_say_not_measured_with_the_command(tmp_path):
    readme = render_writeup(tmp_path / "none", tmp_path / "out", sections=SECTIONS).readme.read_text()
    assert "**not measured here**" in readme and "`make bench`" in readme and "`make bench-gpu`" in readme
    assert not re.search(r"\d+\.\d+ ms", readme)
