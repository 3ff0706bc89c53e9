"""The model-family benchmark (``scripts/bench_bucket_family.py``) and its writeup section.

The section is rendered from results files written by the benchmark's own writer
(``family_record``, ``StepRecord.from_steps``) with planted step times whose verdicts we know: a model where auto is
faster round after round, one where auto kept 25 MB's buckets (noise only), one where auto is
slower. One short real run checks that the script writes what the section reads.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cs336_systems.bench.family import FAMILY, FamilyRecord, FamilySetting
from cs336_systems.bench.family.run import AUTO_VARIANT, DEFAULT_VARIANT, FAMILY_VARIANTS, family_record
from cs336_systems.bench.step import COMPUTE_ONLY, TORCH_DDP
from cs336_systems.ddp.auto_bucket import TUNING_ROUNDS
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.kinds import read_any
from cs336_systems.results.paths import results_path
from cs336_systems.results.schema import to_json
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.family_section import family_page
from scripts import bench_bucket_family

from .step_records import records_from_measured
from .test_writeup_allreduce import environment

pytestmark = pytest.mark.problem("beyond")

MB = 2**20
TAG = "cpu2-test-family"
ROUNDS = 8
JITTER = [0.000, 0.003, -0.002, 0.001, -0.003, 0.002, -0.001, 0.000]  # per round, shared by every variant
NOISE = [0.0010, -0.0008, 0.0002, -0.0012, 0.0009, -0.0002, 0.0011, -0.0006]  # auto's own; median 0
# Per model: (auto's offset from 25 MB per round in s, whether auto kept 25 MB's buckets).
PLANTED = {"many-small": (-0.010, False), "few-huge": (0.0, True), "torch-encoder": (+0.020, False)}


def planted_record(name: str, auto_offset: float, same: bool) -> FamilyRecord:
    """A model's record as its ranks would build it, with planted slowest-rank step times."""
    base = {COMPUTE_ONLY: 0.100, DEFAULT_VARIANT: 0.130, TORCH_DDP: 0.128}
    raw = []
    for variant in FAMILY_VARIANTS:
        if variant == AUTO_VARIANT:
            steps = [0.130 + auto_offset + j + n for j, n in zip(JITTER, NOISE)]
        else:
            steps = [base[variant] + j for j in JITTER]
        buckets = None
        if variant == DEFAULT_VARIANT or (variant == AUTO_VARIANT and same):
            buckets = [MB, 3 * MB]
        elif variant == AUTO_VARIANT:
            buckets = [MB, MB, 2 * MB]
        raw.append(dict(variant=variant, step_times_s=steps,
                        sync_times_s=None if variant in (COMPUTE_ONLY, TORCH_DDP) else [0.01] * ROUNDS,
                        n_buckets=len(buckets) if buckets else None, bucket_bytes=buckets))
    member = FAMILY[name]
    caps = [4 * MB, 2 * MB] if not same else [25 * MB]
    return family_record(
        member, records_from_measured(raw, member.global_batch * member.context_length), n_parameters=1_000_000,
        n_tensors=12, gradient_bytes=4 * MB, largest_parameter_bytes=MB, calibration_o_s=500e-6,
        calibration_w_bytes_per_s=1e9, model_cap_bytes=2 * MB, candidate_caps_bytes=caps,
        candidate_median_s=[0.13, 0.12] if not same else [None], chosen_cap_bytes=caps[-1],
        tuning_steps=1 + TUNING_ROUNDS * len(caps) if not same else 1,
    )


def render(tmp_path: Path, models: dict[str, tuple[float, bool]], scale: float = 1.0) -> str:
    """The page from planted records whose times are all multiplied by ``scale``, rendered twice alike."""
    root = tmp_path / "results"
    records = [planted_record(name, *planted) for name, planted in models.items()]
    for r in records:
        for s in r.steps:
            s.step_times_s[:] = [t * scale for t in s.step_times_s]
    setting = FamilySetting(models=tuple(models), rounds=ROUNDS)
    write_results(results_path("bucket_family", TAG, root=root),
                  ResultsFile("bucket_family", environment(), to_json(setting), records, {"threads_per_rank": 1}))
    first = render_writeup(root, tmp_path / "a", pages=[family_page]).text()
    second = render_writeup(root, tmp_path / "b", pages=[family_page]).text()
    assert first == second
    return first


def cells(text: str, model: str) -> list[str]:
    """The results table's row of ``model`` (the last table naming it)."""
    row = [line for line in text.splitlines() if line.startswith(f"| `{model}` |")][-1]
    return [c.strip() for c in row.split("|")[1:-1]]


def test_each_models_verdict_follows_its_interval(tmp_path):
    text = render(tmp_path, PLANTED)
    assert cells(text, "few-huge")[-1] == "indistinguishable here (same buckets)"
    many, encoder = cells(text, "many-small"), cells(text, "torch-encoder")
    assert many[-2].startswith("-10.0 (") and many[-1] == "bucketed-auto faster"
    assert encoder[-2].startswith("+20.0 (") and encoder[-1] == "bucketed-auto slower"
    assert "Auto is slower than 25 MB beyond the noise on `torch-encoder`." in text
    assert ("Auto kept 25 MB's layout on 1 of the 3 models (`few-huge`): no other layout beat it in every tuning "
            "round, or no other layout existed.") in text


def test_the_summary_says_when_auto_never_loses(tmp_path):
    text = render(tmp_path, {k: PLANTED[k] for k in ("many-small", "few-huge")})
    assert ("On no model of the family is auto slower than 25 MB beyond the noise; it is faster on `many-small`."
            in text)


def test_noise_in_the_last_bits_does_not_change_the_page(tmp_path):
    assert render(tmp_path / "exact", PLANTED) == render(tmp_path / "noisy", PLANTED, 1 + 1e-12)


def test_the_setting_and_the_shapes_are_stated(tmp_path):
    text = render(tmp_path, PLANTED)
    assert f"{ROUNDS} interleaved rounds" in text
    assert "The 2 ranks × 1 thread fill the 2 cores" in text
    assert FAMILY["few-huge"].shape in text and "| 4.00 | 1.00 |" in text  # s and the largest parameter, in MB


def test_no_results_say_not_measured_with_the_command(tmp_path):
    text = render_writeup(tmp_path / "none", tmp_path / "out", pages=[family_page]).text()
    assert "Not measured here: the family on gloo on CPU, NCCL on GPUs" in text


def test_a_batch_that_does_not_split_is_refused_before_any_start():
    with pytest.raises(ValueError, match="model many-small: batch of 8 examples cannot be split evenly over world size 3"):
        FamilySetting(world_size=3).validate()


@pytest.mark.timeout(300)
def test_a_short_real_run_writes_what_the_section_reads(tmp_path, capsys):
    out = tmp_path / "bucket_family.json"
    assert bench_bucket_family.main(["--models", "many-small", "--rounds", "1", "--warmup-steps", "0",
                                     "--out", str(out)]) == 0
    [record] = read_any(out).records
    assert [s.variant for s in record.steps] == list(FAMILY_VARIANTS)
    auto = next(s for s in record.steps if s.variant == AUTO_VARIANT)
    assert record.chosen_cap_bytes in record.candidate_caps_bytes and auto.bucket_cap_bytes == record.chosen_cap_bytes
    distinct = len(record.candidate_caps_bytes)
    assert record.tuning_steps == (1 if distinct == 1 else 1 + TUNING_ROUNDS * distinct)
    assert "many-small" in capsys.readouterr().out
