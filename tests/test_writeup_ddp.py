"""The writeup's DDP sections (problems 2 to 6a), built only from results files written with the benchmarks' writers.

A small results tree is written here by code, through the benchmarks' own record types and
``StepRecord.from_steps``, with planted values whose rendering we know: eight rounds of step times
made of a machine drift shared by every variant of a round plus a per-variant offset, so each paired
difference and its sign-test interval are known (flat − naive is -10 ms in every round: resolved;
per-parameter − flat changes sign: indistinguishable); all-reduce times exactly on
``o + bytes / w``; flat's copies; the buckets each cap built, from the tiny model's parameters;
profiled timelines with a known overlap and backward; a world-size-1 NCCL run and a lever
ablation that the problem sections must leave to their own section. Nothing spawns a process.
The overhead model's section (6b) has its own tests.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest

from cs336_basics.model import TransformerLM, expected_parameter_count, model_config
from cs336_systems.bench.allreduce import AllReduceRecord
from cs336_systems.bench.equivalence import EquivalenceRecord, EquivalenceSetting
from cs336_systems.bench.profile import ProfileRecord, ProfileSetting, StepTimeline
from cs336_systems.bench.step import (
    COMPUTE_ONLY,
    TORCH_DDP,
    StepRecord,
    StepSetting,
    bucket_size_of,
)
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import PROFILE_DIR, results_dir, results_path
from cs336_systems.results.schema import to_json
from cs336_systems.units import MB
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.bucketed_section import comparisons, sweep_verdict
from cs336_systems.writeup.ddp_analysis import bucket_sweep
from cs336_systems.writeup.ddp_sections import (
    all_variants_section,
    bucketed_benchmarking_section,
    flat_benchmarking_section,
    naive_benchmarking_section,
    overlap_benchmarking_section,
)
from cs336_systems.writeup.profile_figure import render_timelines
from cs336_systems.writeup.step_setting import gpu_notes

from .step_records import records_from_measured
from .test_writeup_allreduce import PLANTED_O_S, PLANTED_W, environment, line_records

pytestmark = pytest.mark.problem("beyond")

TAG, GPU_TAG, PROFILE_ONLY_TAG = "cpu2-test-xeon", "1xtest-gpu", "cpu2-profiled-only"
SECTIONS = [naive_benchmarking_section, flat_benchmarking_section, overlap_benchmarking_section,
            bucketed_benchmarking_section, all_variants_section]
PROBLEMS = ["naive_ddp_benchmarking", "minimal_ddp_flat_benchmarking",
            "ddp_overlap_individual_parameters_benchmarking", "ddp_bucketed_benchmarking"]
CONTEXT, BATCH = 32, 4
N_PARAMETERS = expected_parameter_count(model_config("tiny", CONTEXT))
SWEEP_MB = (0.05, 0.5, 10.0)  # 10 MB holds all of the tiny model's gradients
ROUNDS = 8
DRIFT_S = [0.000, 0.002, -0.002, 0.001, -0.001, 0.000, 0.003, -0.003]  # machine load, the same for a whole round
# per-parameter's own wobble around flat's step: median 0, both signs, so the two are indistinguishable.
WOBBLE_S = [0.000, 0.001, -0.001, 0.002, -0.002, 0.0005, -0.0005, 0.000]
BASE_S = {COMPUTE_ONLY: 0.100, "naive": 0.130, "flat": 0.120, "per-parameter": 0.120, "bucketed-0.05MB": 0.125,
          "bucketed-0.5MB": 0.112, "bucketed-10MB": 0.116, TORCH_DDP: 0.117}
SYNC_S = {"naive": 0.020, "flat": 0.015, "per-parameter": 0.005, "bucketed-0.05MB": 0.006, "bucketed-0.5MB": 0.004,
          "bucketed-10MB": 0.008}
PACK_S, UNPACK_S = 0.002, 0.001
CALLS = {"naive": 22, "flat": 1, "per-parameter": 22, TORCH_DDP: 1}
MAX_DIFFS = [1.1e-8, 2.2e-8, 1.9e-8]


def launch_order() -> list[tuple[str, int]]:
    """The tiny model's parameters, name and gradient bytes, in reverse registration order (how
    bucketed DDP first orders them; for this model also the order backward produces them)."""
    model = TransformerLM(model_config("tiny", CONTEXT))
    return [(n, 4 * p.numel()) for n, p in reversed(list(model.named_parameters()))]


def planted_plan(cap_mb: float) -> list[list[str]]:
    """Buckets as the planner builds them, worked out by hand: the first bucket (capped at 1 MB)
    takes the LM head alone, it being larger; after it, fill up to the cap."""
    order = launch_order()
    buckets, used = [[order[0][0]]], 0.0
    buckets.append([])
    for name, size in order[1:]:
        if buckets[-1] and used + size > cap_mb * MB:
            buckets.append([])
            used = 0.0
        buckets[-1].append(name)
        used += size
    return buckets


def payloads(plan: list[list[str]]) -> list[int]:
    sizes = dict(launch_order())
    return [sum(sizes[n] for n in bucket) + 4 * len(bucket) for bucket in plan]  # + one float32 flag each


def step_records(setting: StepSetting, base: dict[str, float] = BASE_S,
                 wobbled: tuple[str, ...] = ("per-parameter",)) -> list[StepRecord]:
    raw = []
    for name in setting.variant_names():
        steps = [base.get(name, 0.15) + d + (w if name in wobbled else 0.0) for d, w in zip(DRIFT_S, WOBBLE_S)]
        size = bucket_size_of(name)
        plan = None if size is None else planted_plan(size)
        raw.append(dict(
            variant=name, step_times_s=steps,
            sync_times_s=None if name in (COMPUTE_ONLY, TORCH_DDP) else [SYNC_S.get(name, 0.01)] * ROUNDS,
            allreduce_calls_per_step=None if name == COMPUTE_ONLY else CALLS.get(name, len(plan) if plan else None),
            n_buckets=len(plan) if plan else None,
            bucket_cap_bytes=size * MB if size is not None else None,
            bucket_bytes=payloads(plan) if plan else None,
            first_bucket_cap_bytes=1.0 * MB if plan else None,
            bucket_params=plan,
            pack_times_s=[PACK_S] * ROUNDS if name == "flat" else None,
            unpack_times_s=[UNPACK_S] * ROUNDS if name == "flat" else None,
        ))
    return records_from_measured(raw, setting.tokens_per_step)


def timeline(backward: tuple[float, float], communication: list[tuple[float, float]]) -> StepTimeline:
    """A CPU step of 100 µs with the given backward range and all-reduces."""
    b0, b1 = backward
    phases = {"forward": (0, b0), "backward": backward, "finish_gradient_synchronization": (b1, 80),
              "optimizer_step": (80, 100)}
    return StepTimeline(100.0, phases, [(b0 + 2, b1 - 2)], communication, len(communication), False, "gloo")


# naive: backward [10, 50] (40 µs), all-reduces after it (25 µs); per-parameter: backward [10, 60]
# (50 µs, +25%), all-reduce [30, 62] (32 µs), of which 30 µs lie inside backward (93.8%).
PROFILED = {"naive": ((10.0, 50.0), [(55.0, 70.0), (70.0, 80.0)]), "per-parameter": ((10.0, 60.0), [(30.0, 62.0)])}


def profile_records() -> list[ProfileRecord]:
    return [ProfileRecord.from_timelines(v, f"trace_{v}.json", [timeline(b, c)]) for v, (b, c) in PROFILED.items()]


def write(path: Path, kind: str, records: list, setting: object, env=None, notes=None) -> None:
    setting_json = setting if isinstance(setting, dict) else to_json(setting)
    write_results(path, ResultsFile(kind, env or environment(), setting_json, records, notes or {}))


NOTES = {"n_parameters": N_PARAMETERS, "threads_per_rank": 1, "ranks_on_node": 2, "host_memory_bytes": 8 * 10**9}


def step_setting(**kwargs) -> StepSetting:
    return StepSetting(model_size="tiny", context_length=CONTEXT, global_batch=BATCH, rounds=ROUNDS, steps_per_round=1,
                       **kwargs)


def build_results_tree(root: Path, rehearsal: bool = True, **planted) -> Path:
    """The tree; ``planted`` (base, wobbled) replaces the main run's step times."""
    results = root / "results"
    setting = step_setting(bucket_sizes_mb=SWEEP_MB)
    write(results_path(StepRecord.KIND, TAG, root=results), StepRecord.KIND, step_records(setting, **planted),
          setting, notes=NOTES)
    ablation = step_setting(variants=(COMPUTE_ONLY, "flat"))
    write(results_path(StepRecord.KIND, TAG, suffix="ablation", root=results), StepRecord.KIND,
          step_records(ablation), ablation, notes=NOTES)
    write(results_path(AllReduceRecord.KIND, TAG, root=results), AllReduceRecord.KIND,
          line_records("gloo", "cpu", [2]), {"iters": 5})
    write(results_path(EquivalenceRecord.KIND, TAG, root=results), EquivalenceRecord.KIND,
          [EquivalenceRecord("naive", 2, 3, 32, 0, 1e-5, MAX_DIFFS, max(MAX_DIFFS), True)], EquivalenceSetting(steps=3))
    profile = ProfileSetting(model_size="tiny", context_length=CONTEXT, global_batch=BATCH)
    for tag in (TAG, PROFILE_ONLY_TAG):
        write(results_dir(tag, results) / PROFILE_DIR / "profile.json", ProfileRecord.KIND, profile_records(), profile,
              notes={"threads_per_rank": 1, "ranks_on_node": 2})
    if rehearsal:
        nccl1 = StepSetting(device="cuda", backend="nccl", world_size=1, model_size="tiny", context_length=CONTEXT,
                            global_batch=BATCH, bucket_sizes_mb=SWEEP_MB, rounds=ROUNDS, steps_per_round=1)
        write(results_path(StepRecord.KIND, GPU_TAG, suffix="nccl1", root=results), StepRecord.KIND,
              step_records(nccl1), nccl1, env=environment("cuda", "nccl", 1, gpu_count=1),
              notes={**NOTES, "ranks_on_node": 1})
    return results


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("writeup-ddp")
    results = build_results_tree(root)
    first = render_writeup(results, root / "a", sections=SECTIONS)
    render_writeup(results, root / "b", sections=SECTIONS)
    return {"root": root, "first": first, "readme": first.text()}


def section(readme: str, heading_start: str) -> str:
    return readme.split(f"## {heading_start}")[1].split("\n## ")[0]


def machine_part(text: str, tag: str = TAG) -> str:
    """One machine's part of a section (its run heading up to the next)."""
    return text.split(f"### Machine `{tag}`")[1].split("\n### ")[0]


def output_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_rendering_twice_gives_byte_identical_files(rendered):
    a, b = output_files(rendered["root"] / "a"), output_files(rendered["root"] / "b")
    assert sorted(a) == sorted(b)
    for name in ("timeline_overlap", "bucket_sweep", "step_time"):
        assert any(name in f for f in a), f"no {name} figure in {sorted(a)}"
    for name in a:
        assert a[name] == b[name], f"{name} differs between two renders of the same results"


def test_every_problem_has_a_section(rendered):
    headings = [line for line in rendered["readme"].splitlines() if line.startswith("## ")]
    for problem in PROBLEMS:
        assert any(re.match(rf"## {problem}\b", h) for h in headings), f"no section for {problem}: {headings}"


def test_numbers_are_the_results_files_numbers(rendered):
    readme = rendered["readme"]
    naive_median_ms = statistics.median(BASE_S["naive"] + d for d in DRIFT_S) * 1e3
    assert f"| naive | – | 22 | {naive_median_ms:.3g} |" in readme
    assert "93.8%" in section(readme, "ddp_overlap_individual_parameters_benchmarking")


def test_a_difference_whose_interval_excludes_zero_is_stated_with_its_sign(rendered):
    flat = machine_part(section(rendered["readme"], "minimal_ddp_flat_benchmarking"))
    # flat − naive is -10 ms in every round: the interval is [-10, -10].
    assert ("flat's step is 10.0 ms shorter than naive's (median of per-round differences -10.0 ms, "
            "95% interval -10.0 to -10.0 ms)") in flat


def test_a_difference_whose_interval_holds_zero_is_indistinguishable(rendered):
    overlap = machine_part(section(rendered["readme"], "ddp_overlap_individual_parameters_benchmarking"))
    low, high = sorted(WOBBLE_S)[0] * 1e3, sorted(WOBBLE_S)[-1] * 1e3  # 8 rounds: the interval is min..max
    assert (f"per-parameter and flat are indistinguishable here (per-parameter − flat per round: 0 ms, "
            f"95% interval {low:.2f} to {high:.2f} ms)") in overlap
    assert "The time after backward shrinks by more than the step does (-15.0 against -10.0 ms per round)" in overlap
    every = section(rendered["readme"], "All DDP variants")
    assert "| per-parameter − naive | -10.0 | -12.0 to -8.00 | per-parameter faster |" in every


def test_flat_time_is_split_into_copies_and_the_all_reduce(rendered):
    flat = machine_part(section(rendered["readme"], "minimal_ddp_flat_benchmarking"))
    sync = SYNC_S["flat"]
    assert (f"the copy in takes {PACK_S * 1e3:.2f} ms and the copy back {UNPACK_S * 1e3:.2f} ms (medians, slowest "
            f"rank): {(PACK_S + UNPACK_S) / sync:.1%} of its {sync * 1e3:.1f} ms") in flat
    predicted_ms = (PLANTED_O_S + 4 * N_PARAMETERS / PLANTED_W) * 1e3
    assert f"predicts o + s/w = {predicted_ms:.2f} ms for one all-reduce of s = 5.20 MB" in flat
    left_ms = (sync - PACK_S - UNPACK_S) * 1e3
    assert f"without the copies {left_ms:.1f} ms are left for the all-reduce itself" in flat


def test_columns_and_setting_are_defined(rendered):
    naive = section(rendered["readme"], "naive_ddp_benchmarking")
    assert "sync share (median of per-step ratios)" in naive
    assert "*sync share*: the median over steps of each step's sync / step ratio" in naive
    assert "d_model 64, d_ff 128, 2 layers, 4 heads" in naive and f"{N_PARAMETERS / 1e6:.2f}M parameters" in naive
    assert "1 untimed warm-up step" in naive and "its time is the slowest rank's" in naive
    assert "Each of the 2 ranks on this machine computed with 1 thread (2 compute threads on 2 logical cores" in naive
    n_xl = expected_parameter_count(model_config("xl", CONTEXT))
    assert f"{16 * n_xl / 1e9:.1f} GB per rank" in naive and "against 8.00 GB of memory on this machine" in naive
    flat = section(rendered["readme"], "minimal_ddp_flat_benchmarking")
    assert "(stated in full under naive_ddp_benchmarking)" in flat


def test_the_bucket_plan_explains_two_buckets_at_a_cap_above_all_gradients(rendered):
    sweep = machine_part(section(rendered["readme"], "ddp_bucketed_benchmarking"))
    head_bytes = dict(launch_order())["lm_head.weight"]
    s_mb = 4 * N_PARAMETERS / MB
    assert f"The cap of 10 MB holds all s = {s_mb:.2f} MB of gradients, yet it built 2 buckets " in sweep
    assert (f"`lm_head.weight` (the output layer, 10000 × 64, {head_bytes / MB:.2f} MB), is larger than that cap, "
            "so it forms the first bucket alone") in sweep
    assert "`first_bucket_mb` = 1 MB" in sweep
    assert "With the lever off (`first_bucket_mb=None`), the same order and cap give 1 bucket." in sweep
    first, rest = payloads(planted_plan(10.0))
    assert f"then {rest / MB:.2f} MB holding {len(launch_order()) - 1} parameters" in sweep  # the plan's list
    assert f"(bucketed-10MB: {first / MB:.2f} MB and {rest / MB:.2f} MB, in launch order)" in sweep


def test_the_sweep_answer_follows_the_intervals(rendered):
    sweep = machine_part(section(rendered["readme"], "ddp_bucketed_benchmarking"))
    # 0.5 MB is 8 ms below flat and 8 ± 2 ms below per-parameter in every round: both resolved.
    assert "**Does the sweep match that?** Yes:" in sweep
    assert "| bucketed-0.5MB − flat | -8.00 | -8.00 to -8.00 | bucketed-0.5MB faster |" in sweep
    # The profile: per-parameter's backward 50 µs against naive's 40 (+25%), on 2 ranks x 1 thread on 2 cores.
    assert "per-parameter DDP's backward took 0.0500 ms against naive's 0.0400 ms (+25.0%)" in sweep
    assert "**What else bends it here:**" in sweep and "**What change would make it match?**" not in sweep


def test_a_sweep_inside_the_noise_does_not_match_and_says_what_would(tmp_path):
    # Every size steps like flat, give or take per-parameter's wobble: nothing is resolved.
    base = {**BASE_S, **{f"bucketed-{mb:g}MB": BASE_S["flat"] for mb in SWEEP_MB}}
    wobbled = tuple(f"bucketed-{mb:g}MB" for mb in SWEEP_MB) + ("per-parameter",)
    results = build_results_tree(tmp_path, rehearsal=False, base=base, wobbled=wobbled)
    readme = render_writeup(results, tmp_path / "out", sections=[bucketed_benchmarking_section]).text()
    assert "**Does the sweep match that?** No:" in readme and "**Why not?**" in readme
    assert ("**What change would make it match?**\n\n- Give communication cores of its own: the same 2 ranks × 1 "
            "compute thread plus one gloo thread each need 4 cores, this machine has 2.") in readme
    assert "- More rounds than this run's 8" in readme


def test_the_verdict_needs_an_interval_not_a_median():
    raw = [dict(variant=name, step_times_s=[0.1 + d + (w if name != COMPUTE_ONLY else 0) for d, w in zip(DRIFT_S, WOBBLE_S)],
                bucket_cap_bytes=MB if name.startswith("bucketed") else None)
           for name in (COMPUTE_ONLY, "flat", "per-parameter", "bucketed-1MB", "bucketed-2MB")]
    records = records_from_measured(raw, tokens_per_step=1)
    v = {r.variant: r for r in records}
    sweep = bucket_sweep(records)
    text = sweep_verdict(sweep, v, comparisons(sweep, v))
    assert text.startswith("**Does the sweep match that?** No:")
    assert "the sizes are indistinguishable here" in text


def test_the_profile_says_where_it_comes_from_and_what_it_trained(rendered):
    overlap = section(rendered["readme"], "ddp_overlap_individual_parameters_benchmarking")
    assert "not from Nsight Systems" in overlap
    assert ("nsys profile -t cuda,nvtx,osrt -o ddp_profile torchrun --nproc-per-node 2 scripts/profile_ddp.py "
            "--device cuda --model-size tiny --context-length 32 --global-batch 4") in overlap
    assert "The profile trains the same model on the same batch as the step benchmark's run" in overlap
    assert "so backward is longer and the all-reduces are longer" in overlap


def test_settings_are_named(rendered):
    readme = rendered["readme"]
    assert "Test Xeon Processor (2 logical cores)" in readme
    assert "torch 2.99.0" in readme and "commit abcdef0" in readme
    assert "model tiny (1.36M parameters)" in readme and "global batch 4 × context 32" in readme
    assert "8 timed steps per variant in 8 interleaved rounds" in readme
    assert "2031" not in readme


def test_the_ablation_run_is_left_to_its_own_section(rendered):
    assert "ddp_step-ablation" not in rendered["readme"]


def test_a_world_size_1_run_is_labelled_as_each_wrappers_own_cost(rendered):
    naive = section(rendered["readme"], "naive_ddp_benchmarking")
    assert f"### Machine `{GPU_TAG}` · `ddp_step-nccl1.json`" in naive
    assert "**NCCL, world size 1: each wrapper's own cost, no communication.**" in naive
    rehearsal = machine_part(naive, GPU_TAG)
    assert "each difference from the compute-only step is the wrapper's own work" in rehearsal
    assert "| naive − compute-only | +30.0 | 30.0 to 30.0 | naive slower |" in rehearsal
    # One rank is no multi-GPU measurement: the NCCL setting is still to be measured.
    assert "DDP step benchmark, NCCL on GPUs (`nccl`): **not measured here**; `make bench-gpu`" in naive
    assert "NCCL at world size 1 on one GPU" not in naive


def test_without_the_rehearsal_the_sections_name_the_command(tmp_path):
    results = build_results_tree(tmp_path, rehearsal=False)
    readme = render_writeup(results, tmp_path / "out", sections=[naive_benchmarking_section]).text()
    assert ("NCCL at world size 1 on one GPU (`ddp_step-nccl1.json`: each wrapper's own cost, no communication): "
            "**not measured here**; `make bench-gpu` on a machine with one GPU fills it.") in readme


def test_gpu_runs_say_how_gloo_and_a_shared_gpu_bend_the_numbers():
    shared = " ".join(gpu_notes(environment("cuda", "gloo", 2, gpu_count=1, shared_gpu=True)))
    assert "copies each tensor to host memory" in shared and "take turns on one GPU" in shared
    assert gpu_notes(environment("cuda", "nccl", 2, gpu_count=2)) == [] and gpu_notes(environment()) == []


def test_timelines_are_drawn_from_the_stored_intervals(rendered, tmp_path):
    overlap = section(rendered["readme"], "ddp_overlap_individual_parameters_benchmarking")
    figure = f"../figures/{TAG}_profile_timeline_overlap.png"
    assert f"]({figure})" in overlap
    expected = render_timelines([(r.variant, r.timeline) for r in profile_records()], tmp_path / "expected.png")
    assert (rendered["root"] / "a" / "details" / figure).read_bytes() == expected.read_bytes()
    assert f"[timeline_naive](../figures/{TAG}_profile_timeline_naive.png)" in overlap
    # A machine with a profile but no step run still shows it, under its own heading.
    assert f"### Machine `{PROFILE_ONLY_TAG}`\n\n#### Profile of one step on `{PROFILE_ONLY_TAG}`" in overlap


def test_no_results_at_all_renders_every_gap_with_its_command(tmp_path):
    readme = render_writeup(tmp_path / "no-results", tmp_path / "out", sections=SECTIONS).text()
    for problem in PROBLEMS:
        assert f"## {problem}" in readme
    assert "make bench-gpu" in readme and "`make bench`" in readme
    assert "Profiler timelines, gloo on CPU (`gloo`): **not measured here**" in readme
    assert not re.search(r"\d+\.\d+ ms", readme)  # not a single measured time


def test_bucket_sizes_of_the_sweep_exclude_levers():
    records = step_records(StepSetting(bucket_sizes_mb=(10.0, 0.05), rounds=ROUNDS, steps_per_round=1, variants=(
        COMPUTE_ONLY, "bucketed-10MB", "bucketed-0.05MB", "bucketed-10MB-copy", "bucketed-auto")))
    assert [r.variant for r in bucket_sweep(records)] == ["bucketed-0.05MB", "bucketed-10MB"]
