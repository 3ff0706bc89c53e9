"""The writeup's lever-ablation section, from a ``ddp_step-ablation.json`` written with the benchmark's writer.

Records are built by the benchmark's own ``StepRecord.from_steps`` from planted step times whose readings we
know: one lever whose per-round difference from the default changes sign from round to round
(indistinguishable here) and one whose difference is the same in every round (stated with its
sign), variants resolved shorter and longer than torch DDP's, all on top of a machine load that
drifts from round to round and hits every variant of a round alike; the buckets the default and
the no-first-bucket variant built (the tiny model's parameter names), and bfloat16's measured
error. Nothing spawns a process.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from cs336_basics.model import TransformerLM, model_config
from cs336_systems.bench.step import ABLATION_VARIANTS, COMPUTE_ONLY, TORCH_DDP, StepRecord, StepSetting
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import results_path
from cs336_systems.results.schema import to_json
from cs336_systems.units import MB
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.ablation_section import ablation_page

from .step_records import records_from_measured
from .test_writeup_allreduce import environment
from .test_writeup_ddp import output_files

pytestmark = pytest.mark.problem("beyond")

TAG = "cpu2-test-xeon"
ROUNDS = 8  # the fewest for which the 95% sign-test interval exists as min..max (n >= 6)
DRIFT_S = [0.000, 0.002, -0.002, 0.001, -0.001, 0.000, 0.003, -0.003]  # machine load per round
# Copy's own round-to-round deviation: median 0, so its overhead is 18 ms, 2 ms above the
# default's, but one round is 1 ms faster than the default: indistinguishable here.
COPY_EXTRA_S = [0.000, 0.000, -0.003, 0.002, 0.000, 0.001, -0.002, 0.000]
# Step per variant before drift, so exposed overhead = step - 100 ms in every round.
STEP_S = {
    "per-parameter": 0.130,  # 10 ms longer than torch DDP's in every round
    "bucketed-25MB-plain": 0.128,
    "bucketed-25MB-copy": 0.118,  # 2 ms above the default, give or take COPY_EXTRA_S
    "bucketed-25MB-no-first": 0.125,  # 9 ms above the default in every round
    "bucketed-25MB-no-reorder": 0.117,
    "bucketed-25MB": 0.116,  # 4 ms shorter than torch DDP's in every round
    "bucketed-25MB-bf16": 0.112,
    "bucketed-auto": 0.119,
    "torch-ddp": 0.120,
}
AUTO_CAP_BYTES = 3 * MB
PAGES = [ablation_page]
BF16_ERROR = 0.00234  # the relative L2 error the run measured for bfloat16 communication
# The first buckets as built, in launch order (tiny model): with the first-bucket cap the LM head
# alone; without it, the LM head and the next parameters up to the cap.
FIRST_ON = [["lm_head.weight"], ["final_norm.gain", "layers.1.ffn.w2.weight"]]
FIRST_OFF = [["lm_head.weight", "final_norm.gain", "layers.1.ffn.w2.weight"]]


def plan_of(name: str) -> list[list[str]] | None:
    if name == "bucketed-25MB-no-first":
        return FIRST_OFF
    return FIRST_ON if name.startswith("bucketed-") else None


def payloads(plan: list[list[str]]) -> list[int]:
    """Each bucket's bytes: float32 gradients plus one float32 flag per parameter."""
    model = TransformerLM(model_config("tiny", 32))
    sizes = {n: 4 * p.numel() for n, p in model.named_parameters()}
    return [sum(sizes[n] for n in bucket) + 4 * len(bucket) for bucket in plan]


def ablation_records(steps: dict[str, float] = STEP_S, noise: dict[str, list[float]] | None = None,
                     scale: float = 1.0) -> list[StepRecord]:
    """Every ablation variant; ``noise`` (per variant, per round) defaults to copy's own wobble; every time is
    multiplied by ``scale``."""
    noise = {"bucketed-25MB-copy": COPY_EXTRA_S} if noise is None else noise
    raw = []
    for name in ABLATION_VARIANTS:
        bucketed = name.startswith("bucketed-")
        plan = plan_of(name)
        raw.append(dict(
            variant=name,
            step_times_s=[(steps.get(name, 0.100) + d + extra) * scale
                          for d, extra in zip(DRIFT_S, noise.get(name, [0.0] * ROUNDS))],
            sync_times_s=None if name in (COMPUTE_ONLY, TORCH_DDP) else [0.005 * scale] * ROUNDS,
            allreduce_calls_per_step=None if name == COMPUTE_ONLY else 2,
            n_buckets=len(plan) if plan else 2 if name == TORCH_DDP else None,
            bucket_cap_bytes=(AUTO_CAP_BYTES if name == "bucketed-auto" else 25 * MB) if bucketed else None,
            bucket_params=plan,
            bucket_bytes=payloads(plan) if plan else None,
            first_bucket_cap_bytes=1.0 * MB if bucketed and name != "bucketed-25MB-no-first" else None,
            comm_error_rel=BF16_ERROR if name == "bucketed-25MB-bf16" else None,
        ))
    return records_from_measured(raw, tokens_per_step=4 * 32)


def write_ablation(root: Path, records: list[StepRecord] | None = None) -> Path:
    setting = StepSetting(model_size="tiny", context_length=32, global_batch=4, rounds=ROUNDS, steps_per_round=1,
                          ablation=True)
    results = ResultsFile(StepRecord.KIND, environment(), to_json(setting), records or ablation_records(),
                          {"n_parameters": 1362240, "threads_per_rank": 1, "ranks_on_node": 2})
    return write_results(results_path(StepRecord.KIND, TAG, suffix=setting.results_suffix, root=root), results)


def render(tmp_path: Path, out: str = "out", records: list[StepRecord] | None = None) -> str:
    root = tmp_path / out / "results"
    write_ablation(root, records)
    return render_writeup(root, tmp_path / out / "writeup", pages=PAGES).text()


@pytest.fixture(scope="module")
def readme(tmp_path_factory) -> str:
    return render(tmp_path_factory.mktemp("ablation"))


def test_the_ablation_file_is_a_ddp_step_run(tmp_path):
    path = write_ablation(tmp_path)
    assert path.name == "ddp_step-ablation.json" and path.parent.name == TAG


def test_rendering_twice_gives_byte_identical_files(tmp_path):
    render(tmp_path, "a")
    render(tmp_path, "b")
    a, b = output_files(tmp_path / "a" / "writeup"), output_files(tmp_path / "b" / "writeup")
    assert a == b and "details/ablation.md" in a


def test_ablation_table_is_computed_from_the_records(readme):
    # Row: buckets, cap, median step, exposed overhead and interval, step − torch DDP's and interval.
    assert "| bucketed-25MB | 2 | 25 | 116 | 16.0 (16.0 to 16.0) | -4.00 (-4.00 to -4.00) |" in readme
    assert "| bucketed-auto | 2 | 3 | 119 |" in readme  # the chosen cap, in MB
    assert "| compute-only | – | – | 100 | 0 | – |" in readme
    assert "| bucketed-25MB-copy | 2 | 25 | 118 | 18.0 (15.0 to 20.0) |" in readme
    assert "6.00 ms (max − min of its 8 timed steps)" in readme
    assert "### Machine `cpu2-test-xeon` · `ddp_step-ablation.json`" in readme
    assert "8 interleaved rounds" in readme and "Each of the 2 ranks computed with 1 thread" in readme
    assert "figures/" not in readme  # the table is the page: exposed overheads and differences with intervals


def test_every_comparison_is_a_paired_difference_with_its_interval(readme):
    # Copy's difference from the default changes sign from round to round: its interval holds zero.
    assert ("gradient views off: bucketed-25MB-copy and bucketed-25MB are indistinguishable here "
            "(bucketed-25MB-copy − bucketed-25MB per round: 2.00 ms, 95% interval -1.00 to 4.00 ms)") in readme
    # No-first is 9 ms longer in every round: stated with its sign.
    assert ("first-bucket cap off: bucketed-25MB-no-first's step is 9.00 ms longer than bucketed-25MB's (per-round "
            "median, 95% interval 9.00 to 9.00 ms)") in readme
    # Copy − torch DDP runs from -5 to 0 ms: an interval that reaches zero does not exclude it.
    assert ("shorter: bucketed-25MB-no-reorder, bucketed-25MB, bucketed-25MB-bf16, bucketed-auto; longer: "
            "per-parameter, bucketed-25MB-plain, bucketed-25MB-no-first; not resolved: bucketed-25MB-copy.") in readme
    # 8 against torch DDP + 4 levers + bf16; all resolve but copy against torch DDP and against the default.
    assert "This page makes 13 paired comparisons; 11 of them resolve" in readme
    assert "holds" not in readme.split("## Machine")[-1] and "/ torch DDP's" not in readme


def test_the_first_bucket_lever_is_read_from_the_buckets_built(readme):
    assert (f"the first bucket is {(4 * 10000 * 64 + 4) / MB:.2f} MB holding 1 parameter (`lm_head.weight`); with "
            "it off,") in readme
    assert "the first parameter alone is above the 1 MB cap" in readme
    assert "without waiting for the next 2 gradients" in readme


def test_bf16_error_is_reported_from_the_record(readme):
    eps = torch.finfo(torch.bfloat16).eps  # 2**-7: 8 significant bits
    assert f"bfloat16 keeps 8 significant bits, so each rounding to it is off by up to {eps / 2:.3%} of the value" in readme
    assert f"the bfloat16 average differs from the float32 one by {BF16_ERROR:.3%} (relative L2 error)" in readme
    # Medians: per-parameter 130, plain 128, no-first 125, torch 120, auto 119, copy 118, no-reorder 117, default 116.
    assert "one of 11 resolved differences among 13 comparisons, and it is taken against bucketed-25MB, number 8 " \
           "from the slowest of the 9 communicating variants" in readme


def test_a_lone_resolved_bf16_difference_says_it_is_alone_and_against_the_slowest(tmp_path):
    """The review's case: bf16 − default resolves, nothing else does, and the default is the slowest variant."""
    wobble = [0.008, -0.008, 0.008, -0.008, 0.0, 0.0, 0.008, -0.008]  # both signs: unresolved against torch DDP
    steps = {name: 0.120 for name in ABLATION_VARIANTS if name != COMPUTE_ONLY}
    steps |= {"bucketed-25MB": 0.125, "bucketed-25MB-bf16": 0.115}
    text = render(tmp_path, records=ablation_records(steps, {"bucketed-25MB": wobble, "bucketed-25MB-bf16": wobble}))
    assert "bucketed-25MB-bf16's step is 10.0 ms shorter than bucketed-25MB's" in text
    assert ("It is the only resolved difference among the 13 comparisons, and it is taken against bucketed-25MB, the "
            "slowest of the 9 communicating variants by median step.") in text


def test_noise_in_the_last_bits_changes_neither_the_page_nor_the_figure(tmp_path):
    exact, noisy = render(tmp_path, "a"), render(tmp_path, "b", ablation_records(scale=1 + 1e-12))
    assert exact == noisy
    a, b = output_files(tmp_path / "a" / "writeup"), output_files(tmp_path / "b" / "writeup")
    assert a == b and "details/ablation.md" in a


def test_the_main_ddp_step_run_is_not_read_as_an_ablation(tmp_path):
    root = tmp_path / "results"
    records = [r for r in ablation_records() if r.variant in (COMPUTE_ONLY, "per-parameter")]
    write_results(results_path(StepRecord.KIND, TAG, root=root),
                  ResultsFile(StepRecord.KIND, environment(), to_json(StepSetting()), records))
    readme = render_writeup(root, tmp_path / "out", pages=PAGES).text()
    assert "### Machine" not in readme  # no ablation run, so nothing measured
    assert "Not measured here: the lever ablation on gloo on CPU, NCCL on GPUs" in readme


def test_missing_results_say_not_measured_with_the_command(tmp_path):
    readme = render_writeup(tmp_path / "none", tmp_path / "out", pages=PAGES).text()
    assert "Not measured here: the lever ablation on gloo on CPU, NCCL on GPUs" in readme
    assert not re.search(r"\d+\.\d+ ms", readme)
