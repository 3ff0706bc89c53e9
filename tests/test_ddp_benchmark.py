"""The DDP step benchmark: one smoke run of scripts/bench_ddp.py, and everything around it without ranks.

The smoke run (tiny model, context 32, 2 gloo ranks, 3 rounds of one step) uses
``--rebuild-each-round``, so both ways a variant lives are exercised: our wrappers are built,
warmed up and dropped within each round, torch's DDP is built once. Its records must have every
variant, sane figures and the communication pattern each variant promises. The rest (variant
names, settings, the summary statistics, the command line) is checked without starting a rank,
against references worked out here.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.distributed as dist

import cs336_systems.bench.script as bench_script
import scripts.bench_ddp as bench_ddp
from cs336_basics.model import TransformerLM, model_config
from cs336_systems.bench.step import (
    ABLATION_VARIANTS,
    COMPUTE_ONLY,
    TORCH_DDP,
    StepRecord,
    StepRun,
    StepSetting,
    bucket_size_of,
    check_variant_name,
    communication_dtype,
    parse_bucketed,
)
from cs336_systems.bench.step.probes import CopyProbe, comm_dtype_error
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.kinds import read_any
from cs336_systems.results.paths import results_path
from cs336_systems.units import MB

from .script_checks import interrupted_run_writes_nothing, must_not_start, refused_in_one_line
from .step_records import records_from_measured

# The benchmark behind problems 3 to 6a; tests of one problem's figures say which.
pytestmark = pytest.mark.problem("naive_ddp_benchmarking")
CONTEXT, BATCH, ROUNDS = 32, 4, 3
SMOKE_ARGS = [
    "--model-size", "tiny", "--context-length", str(CONTEXT), "--global-batch", str(BATCH),
    "--rounds", str(ROUNDS), "--steps-per-round", "1", "--warmup-steps", "1",
    "--bucket-sizes-mb", "0.05", "1000", "--rebuild-each-round",
]
_run: dict = {}


def smoke(test):
    """A test of the smoke run: one worker runs them all, so the benchmark runs once per session."""
    return pytest.mark.xdist_group("ddp-bench")(pytest.mark.timeout(600)(test))


def bench(tmp_path_factory) -> ResultsFile:
    if not _run:
        out = tmp_path_factory.mktemp("bench") / "ddp_step.json"
        assert bench_ddp.main([*SMOKE_ARGS, "--out", str(out)]) == 0
        _run["results"] = read_any(out)
    return _run["results"]


def by_variant(results: ResultsFile) -> dict[str, StepRecord]:
    return {r.variant: r for r in results.records}


def tiny_model():
    return TransformerLM(model_config("tiny", CONTEXT))


def n_trainable() -> int:
    return sum(1 for p in tiny_model().parameters() if p.requires_grad)


@pytest.mark.problem("naive_ddp_benchmarking")
@smoke
def test_every_variant_is_timed_with_sane_figures(tmp_path_factory):
    results = bench(tmp_path_factory)
    assert [r.variant for r in results.records] == [
        "compute-only", "naive", "flat", "per-parameter", "bucketed-0.05MB", "bucketed-1000MB", "torch-ddp"]
    floor = by_variant(results)[COMPUTE_ONLY].step_times_s
    for r in results.records:
        assert len(r.step_times_s) == r.steps_timed == ROUNDS  # every round timed every variant
        assert 0 < r.min_step_s <= r.median_step_s <= r.max_step_s
        # Paired by round: the median of (this variant's step i - compute-only step i).
        assert r.exposed_overhead_s == pytest.approx(statistics.median(a - b for a, b in zip(r.step_times_s, floor)))
        assert r.tokens_per_s == pytest.approx(BATCH * CONTEXT / r.median_step_s)
        if r.median_sync_s is not None:
            assert 0 <= r.median_sync_s <= r.max_step_s
    env = results.environment
    assert (env.backend, env.world_size, env.device_type, env.shared_gpu) == ("gloo", 2, "cpu", False)
    assert results.setting["model_size"] == "tiny" and results.setting["rebuild_each_round"] is True
    assert results.notes["n_parameters"] == sum(p.numel() for p in tiny_model().parameters())
    # The writeup states threads against cores from these (the test suite's ranks run with 1 thread each).
    assert results.notes["ranks_on_node"] == 2 and results.notes["threads_per_rank"] >= 1
    assert all(r.comm_error_rel is None for r in results.records)  # no narrower comm dtype in the sweep


@pytest.mark.problem("naive_ddp_benchmarking")
@smoke
def test_naive_makes_one_call_per_parameter(tmp_path_factory):
    naive = by_variant(bench(tmp_path_factory))["naive"]
    assert naive.allreduce_calls_per_step == n_trainable() + 1  # + the usage count
    assert naive.median_sync_s > 0 and naive.sync_times_s is not None


@pytest.mark.problem("minimal_ddp_flat_benchmarking")
@smoke
def test_flat_makes_one_call(tmp_path_factory):
    assert by_variant(bench(tmp_path_factory))["flat"].allreduce_calls_per_step == 1


@pytest.mark.problem("minimal_ddp_flat_benchmarking")
@smoke
def test_flat_copies_are_timed_beside_each_step(tmp_path_factory):
    v = by_variant(bench(tmp_path_factory))
    flat = v["flat"]
    assert len(flat.pack_times_s) == len(flat.unpack_times_s) == ROUNDS
    assert all(0 < t < 10 for t in flat.pack_times_s + flat.unpack_times_s)
    assert all(r.pack_times_s is None and r.unpack_times_s is None for name, r in v.items() if name != "flat")


@pytest.mark.problem("ddp_overlap_individual_parameters_benchmarking")
@smoke
def test_per_parameter_makes_one_call_per_parameter(tmp_path_factory):
    assert by_variant(bench(tmp_path_factory))["per-parameter"].allreduce_calls_per_step == n_trainable() + 1


@pytest.mark.problem("ddp_bucketed_benchmarking")
@smoke
def test_bucket_sizes_give_bucket_counts(tmp_path_factory):
    v = by_variant(bench(tmp_path_factory))
    small, huge = v["bucketed-0.05MB"], v["bucketed-1000MB"]
    # The first bucket filled is capped at 1 MiB (first_bucket_mb): the tiny model's LM head
    # (64 x 10000 float32 = 2.4 MiB, first in reverse order) fills it alone; all else is one.
    assert huge.n_buckets == 2 and huge.allreduce_calls_per_step == 2
    assert 1 < small.n_buckets <= n_trainable()
    assert small.allreduce_calls_per_step == small.n_buckets  # rebuilt each round, still reported
    assert (small.bucket_size_mb, huge.bucket_size_mb) == (0.05, 1000)
    assert small.bucket_cap_bytes == pytest.approx(0.05 * MB) and huge.bucket_cap_bytes == 1000 * MB
    torch_ddp = v[TORCH_DDP]
    assert torch_ddp.allreduce_calls_per_step >= 1 and torch_ddp.sync_times_s is None


@pytest.mark.problem("ddp_bucketed_benchmarking")
@smoke
def test_each_bucket_records_its_parameters_and_payload(tmp_path_factory):
    v = by_variant(bench(tmp_path_factory))
    sizes = {n: p.numel() * 4 for n, p in tiny_model().named_parameters()}
    for name in ("bucketed-0.05MB", "bucketed-1000MB"):
        r = v[name]
        names = [n for bucket in r.bucket_params for n in bucket]
        assert sorted(names) == sorted(sizes) and len(r.bucket_params) == r.n_buckets  # each parameter once
        # A bucket's payload: its float32 gradients and one float32 usage flag per parameter.
        assert r.bucket_bytes == [sum(sizes[n] for n in bucket) + 4 * len(bucket) for bucket in r.bucket_params]
        assert r.first_bucket_cap_bytes == 1 * MB
    # The LM head's gradient is ready first and, larger than the 1 MB first-bucket cap, fills it alone.
    assert v["bucketed-1000MB"].bucket_params[0] == ["lm_head.weight"]
    assert v["naive"].bucket_params is None and v["naive"].first_bucket_cap_bytes is None


# -- the probes beside the steps (one in-process rank) -------------------------------------------


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model_with_grads() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def test_bf16_error_is_the_rounding_of_the_same_gradients(one_rank_group):
    model = _model_with_grads()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    # One rank: the float32 average is the gradient itself; bfloat16's is its rounding.
    expected = ((grads.bfloat16().float() - grads).norm() / grads.norm()).item()
    error = comm_dtype_error(list(model.parameters()), torch.bfloat16)
    assert error == pytest.approx(expected) and 0 < error < torch.finfo(torch.bfloat16).eps
    assert comm_dtype_error(list(model.parameters()), torch.float32) == 0.0


def test_the_copy_probe_times_flat_copies_and_leaves_gradients_alone(one_rank_group):
    model = _model_with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    probe = CopyProbe(list(model.parameters()), world_size=1)
    pack_s, unpack_s = probe.time_copies(torch.device("cpu"))
    assert pack_s > 0 and unpack_s > 0
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    packed = probe.buffers[0].data[: sum(b.numel() for b in before)]
    assert torch.equal(packed, torch.cat([b.reshape(-1) for b in before]))


# -- variant names and settings (no ranks) ------------------------------------------------------


def test_bucketed_names_give_sizes_and_levers():
    assert parse_bucketed("bucketed-25MB") == (25.0, {})
    assert parse_bucketed("bucketed-0.5MB-copy") == (0.5, {"gradient_as_bucket_view": False})
    assert parse_bucketed("bucketed-25MB-no-first") == (25.0, {"first_bucket_mb": None})
    assert parse_bucketed("bucketed-auto") == ("auto", {})
    size, levers = parse_bucketed("bucketed-25MB-plain")
    assert size == 25.0 and set(levers) == {"gradient_as_bucket_view", "first_bucket_mb", "reorder_after_first_step"}
    assert bucket_size_of("bucketed-10MB-bf16") == 10.0
    assert bucket_size_of("bucketed-auto") is None and bucket_size_of("flat") is None
    assert communication_dtype("bucketed-10MB-bf16") is torch.bfloat16
    assert communication_dtype("bucketed-10MB") is None and communication_dtype("flat") is None


@pytest.mark.parametrize("name", ["bucketed-0MB", "bucketed--1MB", "bucketed-xMB", "bucketed-10MB-fast",
                                  "bucketed-10", "bucketed-nanMB", "no-such-variant", "ddp"])
def test_unknown_variant_names_are_refused(name):
    with pytest.raises(ValueError, match="unknown variant"):
        check_variant_name(name)


def test_every_ablation_variant_is_a_known_name():
    assert [check_variant_name(n) for n in ABLATION_VARIANTS] == list(ABLATION_VARIANTS)


def test_variant_names_follow_the_setting():
    sweep = StepSetting(bucket_sizes_mb=(1.0, 25.0))
    assert sweep.variant_names() == ["compute-only", "naive", "flat", "per-parameter", "bucketed-1MB",
                                     "bucketed-25MB", "torch-ddp"]
    assert StepSetting(bucket_sizes_mb=(1.0,), no_torch_ddp=True).variant_names()[-1] == "bucketed-1MB"
    assert StepSetting(ablation=True).variant_names() == list(ABLATION_VARIANTS)
    assert StepSetting(variants=("compute-only", "flat")).variant_names() == ["compute-only", "flat"]
    assert StepSetting(ablation=True).results_suffix == "ablation" and StepSetting().results_suffix is None


@pytest.mark.parametrize("kwargs,message", [
    ({"variants": ("naive", "flat")}, "must include 'compute-only'"),
    ({"variants": ("compute-only",), "ablation": True}, "--ablation and --variants"),
    ({"bucket_sizes_mb": (1.0, 1.0)}, "repeated: bucketed-1MB"),
    ({"rounds": 0}, "rounds must be an integer from 1 to"),
    ({"global_batch": 3}, "batch of 3 examples cannot be split evenly over world size 2"),
])
def test_settings_that_cannot_run_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StepSetting(**kwargs).validate()


# -- summary statistics (no ranks) --------------------------------------------------------------

FLOOR_S = [0.100, 0.104, 0.098, 0.110, 0.101, 0.097, 0.103, 0.099]  # the compute-only step per round
EXTRA_S = [0.020, 0.023, 0.018, 0.030, 0.021, 0.019, 0.022, 0.025]  # the variant's cost per round


def planted() -> list[StepRecord]:
    floor = dict(variant=COMPUTE_ONLY, step_times_s=FLOOR_S)
    bucketed = dict(variant="bucketed-25MB", step_times_s=[f + e for f, e in zip(FLOOR_S, EXTRA_S)],
                    sync_times_s=[0.5 * e for e in EXTRA_S], allreduce_calls_per_step=2, n_buckets=2,
                    bucket_cap_bytes=25 * MB, bucket_bytes=[12, 20], first_bucket_cap_bytes=MB,
                    bucket_params=[["head"], ["norm", "embedding"]], comm_error_rel=0.003)
    return records_from_measured([floor, bucketed], tokens_per_step=128)


def test_summary_pairs_each_round_with_its_compute_only_step():
    floor, bucketed = planted()
    steps = sorted(f + e for f, e in zip(FLOOR_S, EXTRA_S))
    assert bucketed.median_step_s == pytest.approx((steps[3] + steps[4]) / 2)  # 8 steps: mean of the middle two
    assert (bucketed.min_step_s, bucketed.max_step_s) == (steps[0], steps[-1])
    extras = sorted(EXTRA_S)
    assert bucketed.exposed_overhead_s == pytest.approx((extras[3] + extras[4]) / 2)
    # Sign-test interval at 95% for 8 rounds: P(Bin(8, 1/2) = 0) = 1/256 <= 2.5% < P(<= 1) = 9/256,
    # so it runs from the smallest to the largest per-round difference.
    assert bucketed.exposed_overhead_ci95_s == pytest.approx([extras[0], extras[-1]])
    assert bucketed.exposed_share == pytest.approx(bucketed.exposed_overhead_s / bucketed.median_step_s)
    assert bucketed.tokens_per_s == pytest.approx(128 / bucketed.median_step_s)
    assert bucketed.median_sync_s == pytest.approx(0.5 * (extras[3] + extras[4]) / 2)
    shares = sorted(0.5 * e / (f + e) for f, e in zip(FLOOR_S, EXTRA_S))
    assert bucketed.sync_share == pytest.approx((shares[3] + shares[4]) / 2)
    assert bucketed.bucket_size_mb == 25.0 and bucketed.is_bucketed and bucketed.steps_timed == 8
    assert floor.exposed_overhead_s == 0 and floor.sync_share is None and floor.bucket_size_mb is None


def test_records_survive_the_results_file(tmp_path):
    from cs336_systems.results.environment import collect_environment
    from cs336_systems.results.schema import to_json

    records = planted()
    path = write_results(tmp_path / "ddp_step.json", ResultsFile(
        StepRecord.KIND, collect_environment("gloo", 2, "cpu"), to_json(StepSetting()), records, {"n_parameters": 7}))
    back = read_any(path)
    assert back.kind == "ddp_step" and back.records == records and back.notes == {"n_parameters": 7}
    bucketed = back.records[1]
    assert bucketed.bucket_params == [["head"], ["norm", "embedding"]] and bucketed.comm_error_rel == 0.003
    assert bucketed.first_bucket_cap_bytes == MB and bucketed.pack_times_s is None
    assert back.setting["bucket_sizes_mb"] == [1.0, 10.0, 100.0, 1000.0]


# -- the command line (no ranks) ----------------------------------------------------------------


@pytest.fixture
def no_ranks(monkeypatch):
    must_not_start(monkeypatch, bench_ddp, "run_step_benchmark")


# The values issue 14 found getting past the parser (or refused only from inside the ranks).
BAD_ARGS = [
    (["--world-size", "0"], "--world-size"),
    (["--bucket-sizes-mb", "-1"], "--bucket-sizes-mb"),
    (["--global-batch", "0"], "--global-batch"),
    (["--rounds", "0"], "--rounds"),
    (["--steps-per-round", "0"], "--steps-per-round"),
    (["--warmup-steps", "-1"], "--warmup-steps"),
    (["--variants", "compute-only", "no-such-variant"], "--variants"),
    (["--variants", "naive", "flat"], "--variants"),
    (["--model-size", "huge"], "--model-size"),
]


@pytest.mark.parametrize("args,flag", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_values_stop_before_any_rank_starts(args, flag, no_ranks, capsys):
    assert flag in refused_in_one_line(bench_ddp.main, args, capsys)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_one_line(no_ranks, capsys):
    line = refused_in_one_line(bench_ddp.main, ["--device", "cuda"], capsys)
    assert "device 'cuda'" in line and "no CUDA GPU is visible" in line


def fake_run(rank: int = 0) -> StepRun:
    return StepRun(planted(), n_parameters=7, world_size=2, shared_gpu=False, rank=rank,
                   threads_per_rank=1, ranks_on_node=2)


def test_the_ablation_is_a_ddp_step_run_of_its_own(monkeypatch, capsys):
    written = []
    monkeypatch.setattr(bench_ddp, "run_step_benchmark", lambda setting: fake_run())
    monkeypatch.setattr(bench_script, "save_results",
                        lambda path, kind, setting, records, environment, notes: written.append(
                            (path, kind, setting, notes)))
    assert bench_ddp.main(["--ablation", "--tag", "some-machine"]) == 0
    assert bench_ddp.main(["--tag", "some-machine"]) == 0
    (ablation, kind, setting, notes), (sweep, *_) = written
    assert ablation == results_path("ddp_step", "some-machine", suffix="ablation")
    assert ablation.name == "ddp_step-ablation.json" and sweep.name == "ddp_step.json"
    assert kind == "ddp_step" and setting.ablation is True
    # What the writeup states the setting from; host memory unknown here, so left out.
    assert notes == {"n_parameters": 7, "threads_per_rank": 1, "ranks_on_node": 2}
    out = capsys.readouterr().out
    assert "bucketed-25MB" in out and "exposed ms" in out  # the console table


def test_only_rank_zero_writes(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_ddp, "run_step_benchmark", lambda setting: fake_run(rank=1))
    assert bench_ddp.main(["--out", str(tmp_path / "ddp_step.json")]) == 0
    assert not (tmp_path / "ddp_step.json").exists()


def test_an_interrupted_run_writes_nothing(monkeypatch, tmp_path, capsys):
    interrupted_run_writes_nothing(monkeypatch, bench_ddp, "run_step_benchmark", tmp_path / "ddp_step.json", capsys)


def test_median_of_an_odd_count_is_the_middle_step():
    """The record's median is the plain median (a cross-check of from_steps on 3 rounds)."""
    flat = StepRecord.from_steps("flat", [0.5, 0.4, 0.6], [0.3, 0.1, 0.2], tokens_per_step=10, sync_times_s=[0.1] * 3,
                                 allreduce_calls_per_step=1)
    assert flat.median_step_s == 0.5 and flat.exposed_overhead_s == pytest.approx(0.3)
    assert flat.exposed_overhead_ci95_s is None  # 3 rounds are too few for a 95% interval
    assert math.isclose(flat.tokens_per_s, 20.0)
