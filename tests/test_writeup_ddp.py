"""The DDP step benchmark's page and answers (naive_ddp_benchmarking to ddp_bucketed_benchmarking (a)),
built only from results files written with the benchmarks' writers.

A small results tree is written here by code, through the benchmarks' own record types and
``StepRecord.from_steps``, with planted values whose rendering we know: eight rounds of step times
made of a machine drift shared by every variant of a round plus a per-variant offset, so each paired
difference and its sign-test interval are known (flat − naive is -10 ms in every round: resolved;
per-parameter − flat changes sign: indistinguishable); all-reduce times exactly on
``o + bytes / w``; flat's copies; the buckets each cap built, from the tiny model's parameters;
profiled timelines with a known overlap and backward; a world-size-1 NCCL run and a lever
ablation that this page must leave to its own. Nothing spawns a process. The profiles (written
here for tests/test_writeup_profile.py) and the overhead model (6b) have their own pages and tests.
"""

from __future__ import annotations

import dataclasses
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
from cs336_systems.writeup import fmt, render_writeup
from cs336_systems.writeup.ddp_sections import comparisons, sweep_verdict
from cs336_systems.writeup.ddp_analysis import bucket_sweep
from cs336_systems.writeup.ddp_sections import ANSWERED, ddp_step_page
from cs336_systems.writeup.pages import machines_page

from .step_records import records_from_measured
from .test_writeup_allreduce import PLANTED_O_S, PLANTED_W, environment, line_records

pytestmark = pytest.mark.problem("beyond")

TAG, GPU_TAG, PROFILE_ONLY_TAG = "cpu2-test-xeon", "1xtest-gpu", "cpu2-profiled-only"
PAGES = [ddp_step_page, machines_page]
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
REHEARSAL_S = {name: 2 * t for name, t in BASE_S.items()}  # the one-GPU run: no row equal to the CPU run's
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


def build_results_tree(root: Path, rehearsal: bool = True, step_env=None, **planted) -> Path:
    """The tree; ``planted`` (base, wobbled) replaces the main run's step times, ``step_env`` its environment."""
    results = root / "results"
    setting = step_setting(bucket_sizes_mb=SWEEP_MB)
    write(results_path(StepRecord.KIND, TAG, root=results), StepRecord.KIND, step_records(setting, **planted),
          setting, env=step_env, notes=NOTES)
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
              step_records(nccl1, base=REHEARSAL_S), nccl1, env=environment("cuda", "nccl", 1, gpu_count=1),
              notes={**NOTES, "ranks_on_node": 1})
    return results


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("writeup-ddp")
    results = build_results_tree(root)
    first = render_writeup(results, root / "a", pages=PAGES)
    render_writeup(results, root / "b", pages=PAGES)
    page = (root / "a" / "details" / "ddp_step.md").read_text()
    return {"root": root, "first": first, "readme": first.readme.read_text(), "page": page,
            "answers": answers(first.readme.read_text())}


def answers(readme: str) -> dict[str, str]:
    """The README's answers by problem, in the order they appear."""
    body = readme.split("\n## Answers\n", 1)[1].split("\n## Details\n", 1)[0]
    # Each answer is '<a id="name"></a>' and '### name (its editions)' (writeup.render.heading).
    parts = re.split(r'^(?:<a id="[^"]+"></a>\n)?### (\S+)(?: \([^)\n]*\))?\n', body, flags=re.M)[1:]
    return dict(zip(parts[::2], parts[1::2]))


def run_part(page: str, tag: str = TAG) -> str:
    """One run's part of the details page (its heading up to the next)."""
    return page.split(f"## `{tag}`")[1].split("\n## ")[0]


def output_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


# writeup/'s inputs, not what `make writeup` renders: results files, and the grading footprint
# (`make footprint`), which the README quotes.
WRITEUP_INPUTS = ("results/", "footprint/")


def committed_outputs(writeup: Path) -> dict[str, bytes]:
    """The committed files `make writeup` renders under ``writeup`` (its inputs left out)."""
    return {name: data for name, data in output_files(writeup).items() if not name.startswith(WRITEUP_INPUTS)}


def ms(seconds: float) -> str:
    return fmt.ms(seconds)


def test_rendering_twice_gives_byte_identical_files(rendered):
    a, b = output_files(rendered["root"] / "a"), output_files(rendered["root"] / "b")
    assert sorted(a) == sorted(b)
    for name in ("bucket_sweep", "step_time"):
        assert any(name in f for f in a), f"no {name} figure in {sorted(a)}"
    for name in a:
        assert a[name] == b[name], f"{name} differs between two renders of the same results"


def test_every_problem_is_answered_with_a_link_to_its_run(rendered):
    assert list(rendered["answers"]) == list(ANSWERED)
    for problem in ANSWERED:
        assert f"(details/ddp_step.md#{TAG}-ddp-step)" in rendered["answers"][problem], problem


def test_each_run_has_one_table_with_every_variant_and_no_row_twice(rendered):
    from .test_writeup import repeated_rows

    page = rendered["page"]
    assert repeated_rows([rendered["readme"], page]) == []
    naive_median = statistics.median(BASE_S["naive"] + d for d in DRIFT_S)
    part = run_part(page)
    assert f"| naive | – | 22 | {ms(naive_median)} |" in part
    assert part.count(f"| {COMPUTE_ONLY} |") == 1 and part.count(f"| {TORCH_DDP} |") == 1
    assert f"| {COMPUTE_ONLY} |" in run_part(page, GPU_TAG)
    assert "profile" not in page.lower() and "timeline" not in page.lower()


def test_a_difference_whose_interval_excludes_zero_is_stated_with_its_sign(rendered):
    flat = rendered["answers"]["minimal_ddp_flat_benchmarking"]
    # flat − naive is -10 ms in every round: the interval is [-10, -10].
    assert f"flat's step is {ms(0.010)} ms shorter than naive's" in flat
    assert f"95% interval {ms(-0.010)} to {ms(-0.010)} ms" in flat
    assert f"| flat − naive | {ms(-0.010)} | {ms(-0.010)} to {ms(-0.010)} | flat faster |" in run_part(rendered["page"])


def test_a_difference_whose_interval_holds_zero_is_indistinguishable(rendered):
    overlap = rendered["answers"]["ddp_overlap_individual_parameters_benchmarking"]
    low, high = min(WOBBLE_S), max(WOBBLE_S)  # 8 rounds: the interval is min..max
    assert "per-parameter and flat are indistinguishable here" in overlap
    assert f"95% interval {fmt.ms_interval((low, high))} ms" in overlap
    # per-parameter's sync is 15 ms below naive's, its step 10 ms: the sync shrinks more than the step
    # (on the details page: the answer keeps to the handout's two sentences).
    assert f"({ms(-0.015)} against {ms(-0.010)} ms per round)" in run_part(rendered["page"])


def test_flat_time_is_split_into_copies_and_the_all_reduce(rendered):
    flat, part = rendered["answers"]["minimal_ddp_flat_benchmarking"], run_part(rendered["page"])
    sync = SYNC_S["flat"]
    assert f"{ms(PACK_S + UNPACK_S)} ms of it the copies" in flat
    assert f"copy in {ms(PACK_S)} ms, copy back {ms(UNPACK_S)} ms, {fmt.pct((PACK_S + UNPACK_S) / sync)}" in part
    s_bytes = 4 * N_PARAMETERS
    assert f"o + s/w = {ms(PLANTED_O_S + s_bytes / PLANTED_W)} ms for flat's one call" in part
    assert f"{ms(sync - PACK_S - UNPACK_S)} ms without the copies" in part
    naive = 22 * PLANTED_O_S + s_bytes / PLANTED_W
    assert f"predicts {ms(naive)} ms for them" in rendered["answers"]["naive_ddp_benchmarking"]


def test_the_setting_names_model_batch_optimizer_and_rounds_in_binary_units(rendered):
    part, naive = run_part(rendered["page"]), rendered["answers"]["naive_ddp_benchmarking"]
    assert "Test Xeon Processor (2 logical cores)" in part and "torch 2.99.0" in part and "commit abcdef0" in part
    assert f"model tiny ({fmt.sig(N_PARAMETERS / 1e6)}M parameters)" in part
    assert "global batch 4 × context 32" in part and "AdamW lr 0.0001" in part
    assert f"{ROUNDS} timed steps per variant in {ROUNDS} interleaved rounds" in part
    assert "d_model 64, d_ff 128, 2 layers, 4 heads" in part
    assert "AdamW lr 0.0001" in naive and f"{ROUNDS} interleaved rounds" in naive
    n_xl = expected_parameter_count(model_config("xl", CONTEXT))
    per_rank = 16 * n_xl / 2**30
    assert f"{fmt.sig(per_rank)} GB per rank and {fmt.sig(2 * per_rank)} GB for 2 ranks" in part
    assert f"against {fmt.sig(8 * 10**9 / 2**30)} GB of memory here" in part
    assert f"{fmt.sig(2 * per_rank)} GB" in naive


def test_the_bucket_plan_explains_two_buckets_at_a_cap_above_all_gradients(rendered):
    part = run_part(rendered["page"])
    head_bytes = dict(launch_order())["lm_head.weight"]
    assert f"hold all s = {fmt.mb(4 * N_PARAMETERS)} MB of gradients yet built 2 buckets" in part
    assert f"`lm_head.weight` (10000 × 64, {fmt.mb(head_bytes)} MB), exceeds it" in part
    first, rest = payloads(planted_plan(10.0))
    assert f"- bucketed-10MB: 2 buckets; the first {fmt.mb(first)} MB (1 parameter" in part
    assert f"then {fmt.mb(rest)} MB ({len(launch_order()) - 1})" in part
    assert "caps of 10 MB build 2 buckets, never flat's one" in run_part(rendered["page"]) or \
        "yet built 2 buckets" in part


def test_the_sweep_answer_follows_the_intervals(rendered):
    sweep = rendered["answers"]["ddp_bucketed_benchmarking"]
    # 0.5 MB is 8 ms below flat and 8 ± 2 ms below per-parameter in every round: both resolved.
    assert sweep.count("Matched: **yes**") == 1 and "as 0.5 MB do" in sweep
    assert f"| bucketed-0.5MB − flat | {ms(-0.008)} | {ms(-0.008)} to {ms(-0.008)} | bucketed-0.5MB faster |" in \
        run_part(rendered["page"])
    for mb in SWEEP_MB:
        assert f"| {fmt.size_mb(mb)} |" in sweep


def test_a_sweep_inside_the_noise_does_not_match_and_says_why(tmp_path):
    # Every size steps like flat, give or take per-parameter's wobble: nothing is resolved.
    base = {**BASE_S, **{f"bucketed-{mb:g}MB": BASE_S["flat"] for mb in SWEEP_MB}}
    wobbled = tuple(f"bucketed-{mb:g}MB" for mb in SWEEP_MB) + ("per-parameter",)
    results = build_results_tree(tmp_path, rehearsal=False, base=base, wobbled=wobbled)
    rendered = render_writeup(results, tmp_path / "out", pages=PAGES)
    sweep = answers(rendered.readme.read_text())["ddp_bucketed_benchmarking"]
    assert "Matched: **no**" in sweep and "no size beats flat DDP" in sweep and "no size beats per-parameter DDP" in sweep
    assert "0 of 2 neighbouring sizes differ" in sweep and "[Details](details/ddp_step.md" in sweep
    # The planted rounds make per-parameter's step less its wait longer than naive's: (b) measures the
    # cost, so (a) gives the reason without "not measured".
    assert "Why: 2 ranks fill 2 cores" in sweep and "not measured" not in sweep
    page = next(p for p in rendered.details if p.stem == "ddp_step").read_text()
    assert "2 ranks × 1 thread fill all 2 cores" in page


def test_a_run_that_did_not_record_its_load_decides_no_verdict(tmp_path):
    # The planted tree's resolved differences, from a file without its load record (as written before
    # the load was recorded, on a machine others shared): every row reads "not evidence", no verdict.
    results = build_results_tree(tmp_path, rehearsal=False, step_env=dataclasses.replace(environment(), load=None))
    rendered = render_writeup(results, tmp_path / "out", pages=PAGES)
    found = answers(rendered.readme.read_text())
    assert "Matched: no verdict, since this run's times are not evidence (load not recorded" in \
        found["ddp_bucketed_benchmarking"]
    assert "not evidence: load not recorded" in found["minimal_ddp_flat_benchmarking"]
    assert "shorter" not in found["minimal_ddp_flat_benchmarking"] + found["ddp_overlap_individual_parameters_benchmarking"]
    page = next(p for p in rendered.details if p.stem == "ddp_step").read_text()
    assert "| not evidence: load not recorded |" in page and " faster |" not in page and " slower |" not in page


def test_only_the_largest_size_beating_both_is_no_match(tmp_path):
    # The largest cap alone beats flat (-10 ms every round) and per-parameter (-10 ± 2 ms): no middle size does.
    base = {**BASE_S, "bucketed-0.05MB": 0.125, "bucketed-0.5MB": 0.125, "bucketed-10MB": 0.110}
    results = build_results_tree(tmp_path, rehearsal=False, base=base)
    sweep = answers(render_writeup(results, tmp_path / "out", pages=PAGES).readme.read_text())
    assert "Matched: **no**" in sweep["ddp_bucketed_benchmarking"]
    assert "10 MB beats flat DDP; 10 MB beats per-parameter DDP" in sweep["ddp_bucketed_benchmarking"]


def test_the_verdict_needs_an_interval_not_a_median():
    raw = [dict(variant=name, step_times_s=[0.1 + d + (w if name != COMPUTE_ONLY else 0) for d, w in zip(DRIFT_S, WOBBLE_S)],
                bucket_cap_bytes=MB if name.startswith("bucketed") else None)
           for name in (COMPUTE_ONLY, "flat", "per-parameter", "bucketed-1MB", "bucketed-2MB", "bucketed-3MB")]
    records = records_from_measured(raw, tokens_per_step=1)
    v = {r.variant: r for r in records}
    sweep = bucket_sweep(records)
    verdict = sweep_verdict(sweep, v, comparisons(sweep, v))
    assert verdict["word"] == "no" and verdict["told_apart"] == [] and verdict["adjacent"] == 2


def test_the_ablation_run_is_left_to_its_own_page(rendered):
    assert "ddp_step-ablation" not in rendered["page"] and "ddp_step-ablation" not in rendered["readme"]


def test_a_world_size_1_run_is_each_wrappers_own_cost(rendered):
    page = rendered["page"]
    assert f"## `{GPU_TAG}` · `ddp_step-nccl1.json`: one rank, each wrapper's own cost" in page
    rehearsal = run_part(page, GPU_TAG)
    assert "a − b, per round" not in rehearsal  # its exposed overheads are the only comparisons
    naive = rendered["answers"]["naive_ddp_benchmarking"]
    naive_median = statistics.median(REHEARSAL_S["naive"] + d for d in DRIFT_S)
    floor = statistics.median(REHEARSAL_S[COMPUTE_ONLY] + d for d in DRIFT_S)
    assert f"On `{GPU_TAG}` (NCCL, one rank" in naive and f"{ms(naive_median)} ms against {ms(floor)} ms" in naive
    # One rank is no multi-GPU measurement: the NCCL setting is still listed as not measured.
    machines = (rendered["root"] / "a" / "details" / "machines.md").read_text()
    assert "NCCL" in machines and "make bench-gpu" in machines
    assert "NCCL" in naive.split("were not measured here")[0].splitlines()[-1]
    assert "(details/machines.md#not-measured-here)" in naive


def test_no_results_at_all_renders_every_gap(tmp_path):
    out = render_writeup(tmp_path / "no-results", tmp_path / "out", pages=PAGES)
    found = answers(out.readme.read_text())
    assert list(found) == list(ANSWERED)
    for problem in ANSWERED:
        assert "(details/machines.md#not-measured-here)" in found[problem], problem
    assert "make bench" in (tmp_path / "out" / "details" / "machines.md").read_text()
    assert not re.search(r"\d+\.\d+ ms", out.text())  # not a single measured time


def test_bucket_sizes_of_the_sweep_exclude_levers():
    records = step_records(StepSetting(bucket_sizes_mb=(10.0, 0.05), rounds=ROUNDS, steps_per_round=1, variants=(
        COMPUTE_ONLY, "bucketed-10MB", "bucketed-0.05MB", "bucketed-10MB-copy", "bucketed-auto")))
    assert [r.variant for r in bucket_sweep(records)] == ["bucketed-0.05MB", "bucketed-10MB"]
