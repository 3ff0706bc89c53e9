"""The writeup's DDP sections (problems 2 to 6), built only from results files written with the benchmarks' writers.

A small results tree is written here by code, through the benchmarks' own record types and
``summarize``, with planted values whose rendering we know: step times with a known median,
all-reduce times exactly on ``o + bytes / w`` (so the overhead model's prediction can be
recomputed here), profiled timelines with a known overlap, a world-size-1 NCCL run and a lever
ablation that the problem sections must leave to their own section. Nothing spawns a process.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest

from cs336_systems.bench.allreduce import AllReduceRecord
from cs336_systems.bench.equivalence import EquivalenceRecord, EquivalenceSetting
from cs336_systems.bench.profile import ProfileRecord, ProfileSetting, StepTimeline
from cs336_systems.bench.step import COMPUTE_ONLY, TORCH_DDP, RawVariant, StepRecord, StepSetting, summarize
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import PROFILE_DIR, results_dir, results_path
from cs336_systems.results.schema import to_json
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.ddp_sections import (
    all_variants_section,
    bucketed_benchmarking_section,
    flat_benchmarking_section,
    naive_benchmarking_section,
    naive_ddp_section,
    overlap_benchmarking_section,
)
from cs336_systems.writeup.overhead_section import overhead_model_section
from cs336_systems.writeup.profile_figure import render_timelines

from .test_writeup_allreduce import PLANTED_O_S, PLANTED_W, environment, line_records

pytestmark = pytest.mark.problem("beyond")

TAG, GPU_TAG, PROFILE_ONLY_TAG = "cpu2-test-xeon", "1xtest-gpu", "cpu2-profiled-only"
SECTIONS = [naive_ddp_section, naive_benchmarking_section, flat_benchmarking_section, overlap_benchmarking_section,
            bucketed_benchmarking_section, overhead_model_section, all_variants_section]
PROBLEMS = ["naive_ddp", "naive_ddp_benchmarking", "minimal_ddp_flat_benchmarking",
            "ddp_overlap_individual_parameters_benchmarking", "ddp_bucketed_benchmarking"]
N_PARAMETERS = 1362240  # the tiny model's
NAIVE_STEP_TIMES = [0.0811, 0.0790, 0.0834, 0.0802, 0.0777]  # median 0.0802 s -> "80.2" ms
BASE_S = {COMPUTE_ONLY: 0.030, "flat": 0.045, "per-parameter": 0.060, "bucketed-0.05MB": 0.064,
          "bucketed-0.5MB": 0.044, "bucketed-5MB": 0.043, TORCH_DDP: 0.046}
CALLS = {"naive": 22, "flat": 1, "per-parameter": 22, "bucketed-0.05MB": 10, "bucketed-0.5MB": 3,
         "bucketed-5MB": 2, TORCH_DDP: 1}
BUCKETS = {"bucketed-0.05MB": 10, "bucketed-0.5MB": 3, "bucketed-5MB": 2, TORCH_DDP: 1}
WIGGLE = [1.00, 1.02, 0.99, 1.01, 0.98]  # each variant's steps around its base time
MAX_DIFFS = [1.1e-8, 2.2e-8, 1.9e-8]


def step_records(setting: StepSetting) -> list[StepRecord]:
    raw = []
    for name in setting.variant_names():
        steps = NAIVE_STEP_TIMES if name == "naive" else [BASE_S.get(name, 0.05) * w for w in WIGGLE]
        raw.append(RawVariant(name, steps, None if name in (COMPUTE_ONLY, TORCH_DDP) else [0.4 * t for t in steps],
                              CALLS.get(name), BUCKETS.get(name)))
    return summarize(raw, setting.tokens_per_step)


def timeline(communication: list[tuple[float, float]]) -> StepTimeline:
    """A CPU step of 100 µs: backward over [10, 50], compute in two stretches, the given all-reduces."""
    phases = {"forward": (0, 10), "backward": (10, 50), "finish_gradient_synchronization": (50, 80),
              "optimizer_step": (80, 100)}
    return StepTimeline(100.0, phases, [(12, 30), (32, 48)], communication, len(communication), False, "gloo")


# naive: all-reduce after backward; per-parameter: [30, 62], 20 of its 32 µs inside backward = 62.5%.
PROFILED = {"naive": [(55.0, 70.0), (70.0, 80.0)], "per-parameter": [(30.0, 62.0)]}


def profile_records() -> list[ProfileRecord]:
    return [ProfileRecord.from_timelines(v, f"trace_{v}.json", [timeline(c)]) for v, c in PROFILED.items()]


def write(path: Path, kind: str, records: list, setting: object, env=None, notes=None) -> None:
    setting_json = setting if isinstance(setting, dict) else to_json(setting)
    write_results(path, ResultsFile(kind, env or environment(), setting_json, records, notes or {}))


def build_results_tree(root: Path) -> Path:
    results = root / "results"
    setting = StepSetting(model_size="tiny", context_length=32, global_batch=4, bucket_sizes_mb=(0.05, 0.5, 5),
                          rounds=1, steps_per_round=5)
    notes = {"n_parameters": N_PARAMETERS}
    write(results_path(StepRecord.KIND, TAG, root=results), StepRecord.KIND, step_records(setting), setting,
          notes=notes)
    ablation = StepSetting(model_size="tiny", context_length=32, rounds=1, steps_per_round=5,
                           variants=(COMPUTE_ONLY, "flat"))
    write(results_path(StepRecord.KIND, TAG, suffix="ablation", root=results), StepRecord.KIND,
          step_records(ablation), ablation, notes=notes)
    write(results_path(AllReduceRecord.KIND, TAG, root=results), AllReduceRecord.KIND,
          line_records("gloo", "cpu", [2]), {"iters": 5})
    equivalence = EquivalenceSetting(steps=3)
    write(results_path(EquivalenceRecord.KIND, TAG, root=results), EquivalenceRecord.KIND,
          [EquivalenceRecord("naive", 2, 3, 32, 0, 1e-5, MAX_DIFFS, max(MAX_DIFFS), True)], equivalence)
    profile = ProfileSetting(model_size="tiny", context_length=32)
    for tag in (TAG, PROFILE_ONLY_TAG):
        write(results_dir(tag, results) / PROFILE_DIR / "profile.json", ProfileRecord.KIND, profile_records(), profile)
    rehearsal = StepSetting(device="cuda", backend="nccl", world_size=1, model_size="tiny", context_length=32,
                            global_batch=4, bucket_sizes_mb=(0.05, 0.5, 5), rounds=1, steps_per_round=5)
    write(results_path(StepRecord.KIND, GPU_TAG, suffix="nccl1", root=results), StepRecord.KIND,
          step_records(rehearsal), rehearsal, env=environment("cuda", "nccl", 1, gpu_count=1), notes=notes)
    return results


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("writeup-ddp")
    results = build_results_tree(root)
    first = render_writeup(results, root / "a", sections=SECTIONS)
    render_writeup(results, root / "b", sections=SECTIONS)
    return {"root": root, "first": first, "readme": first.readme.read_text()}


def section(readme: str, heading_start: str) -> str:
    return readme.split(f"## {heading_start}")[1].split("\n## ")[0]


def output_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_rendering_twice_gives_byte_identical_files(rendered):
    a, b = output_files(rendered["root"] / "a"), output_files(rendered["root"] / "b")
    assert sorted(a) == sorted(b)
    for name in ("timeline_overlap", "bucket_sweep", "step_time", "overhead_model"):
        assert any(name in f for f in a), f"no {name} figure in {sorted(a)}"
    for name in a:
        assert a[name] == b[name], f"{name} differs between two renders of the same results"


def test_every_problem_has_a_section(rendered):
    headings = [line for line in rendered["readme"].splitlines() if line.startswith("## ")]
    for problem in PROBLEMS:
        assert any(re.match(rf"## {problem}\b", h) for h in headings), f"no section for {problem}: {headings}"
    overhead = section(rendered["readme"], "ddp_bucketed_benchmarking (b)")
    assert "$$" in overhead and "measured / model" in overhead  # the derivation, then the prediction table


def test_numbers_are_the_results_files_numbers(rendered):
    readme = rendered["readme"]
    naive_median_ms = f"{statistics.median(NAIVE_STEP_TIMES) * 1e3:.1f}"
    assert f"| naive | – | 22 | {naive_median_ms} |" in readme
    assert "62.5%" in section(readme, "ddp_overlap_individual_parameters_benchmarking")
    assert "2.20e-08" in section(readme, "naive_ddp:")


def test_the_model_predicts_from_the_planted_line(rendered):
    """The fit recovers o and w exactly, so T(n_b) = o n_b + s / (w n_b) can be recomputed here."""
    overhead = section(rendered["readme"], "ddp_bucketed_benchmarking (b)")
    s = 4 * N_PARAMETERS
    predicted_ms = (PLANTED_O_S * 2 + s / (PLANTED_W * 2)) * 1e3  # bucketed-5MB built 2 buckets
    assert f"| bucketed-5MB | 5 | 2 | {predicted_ms:.3g} |" in overhead
    assert f"$o$ = {PLANTED_O_S * 1e6:.0f} µs, $w$ = {PLANTED_W / 1e9:.2f} GB/s" in overhead
    # The fit table: payloads in MB, o in µs, w in GB/s, R² 1.
    assert f"| gloo | cpu | 2 | 0.0625, 1, 16 | {PLANTED_O_S * 1e6:.0f} | {PLANTED_W / 1e9:.2f} | 1.000 |" in overhead


def test_settings_are_named(rendered):
    readme = rendered["readme"]
    assert "Test Xeon Processor (2 logical cores)" in readme
    assert "torch 2.99.0" in readme and "commit abcdef0" in readme
    assert "model tiny (1.36M parameters)" in readme and "global batch 4 × context 32" in readme
    assert "5 timed steps per variant in 1 interleaved round " in readme
    assert "2031" not in readme


def test_the_ablation_run_is_left_to_its_own_section(rendered):
    assert "ddp_step-ablation" not in rendered["readme"]


def test_a_world_size_1_run_is_labelled_and_not_modelled(rendered):
    readme = rendered["readme"]
    naive = section(readme, "naive_ddp_benchmarking")
    assert f"### Machine `{GPU_TAG}` · `ddp_step-nccl1.json`" in naive
    assert "**NCCL, world size 1: each wrapper's own cost, no communication.**" in naive
    assert "One rank communicates nothing" in section(readme, "ddp_bucketed_benchmarking (b)")
    # One rank is no multi-GPU measurement: the NCCL setting is still to be measured.
    assert "DDP step benchmark, NCCL on GPUs (`nccl`): **not measured here**; `make bench-gpu`" in naive


def test_timelines_are_drawn_from_the_stored_intervals(rendered, tmp_path):
    overlap = section(rendered["readme"], "ddp_overlap_individual_parameters_benchmarking")
    figure = f"figures/{TAG}_profile_timeline_overlap.png"
    assert f"]({figure})" in overlap
    expected = render_timelines([(r.variant, r.timeline) for r in profile_records()], tmp_path / "expected.png")
    assert (rendered["root"] / "a" / figure).read_bytes() == expected.read_bytes()
    assert f"[timeline_naive](figures/{TAG}_profile_timeline_naive.png)" in overlap
    # A machine with a profile but no step run still shows it, under its own heading.
    assert f"### Machine `{PROFILE_ONLY_TAG}`\n\n#### Profile of one step on `{PROFILE_ONLY_TAG}`" in overlap


def test_no_results_at_all_renders_every_gap_with_its_command(tmp_path):
    readme = render_writeup(tmp_path / "no-results", tmp_path / "out", sections=SECTIONS).readme.read_text()
    for problem in PROBLEMS:
        assert f"## {problem}" in readme
    assert "make bench-gpu" in readme and "`make bench`" in readme
    assert "Profiler timelines, gloo on CPU (`gloo`): **not measured here**" in readme
    assert not re.search(r"\d+\.\d+ ms", readme)  # not a single measured time


def test_bucket_sizes_of_the_sweep_exclude_levers():
    from cs336_systems.writeup.ddp_analysis import bucket_sweep

    records = step_records(StepSetting(bucket_sizes_mb=(5.0, 0.05), variants=(
        COMPUTE_ONLY, "bucketed-5MB", "bucketed-0.05MB", "bucketed-5MB-copy", "bucketed-auto")))
    assert [r.variant for r in bucket_sweep(records)] == ["bucketed-0.05MB", "bucketed-5MB"]
