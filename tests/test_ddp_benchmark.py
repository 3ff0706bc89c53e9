"""Smoke run of the DDP step benchmark: the output has every variant, sane figures and the
communication pattern each variant promises (one run, shared by the tests below)."""

from __future__ import annotations

import json
import statistics

import pytest

from cs336_systems.model import TransformerLM, model_config

_run: dict = {}
SMOKE_ARGS = [
    "--model-size", "tiny", "--context-length", "16", "--global-batch", "4",
    "--rounds", "2", "--steps-per-round", "1", "--warmup-steps", "1",
    "--bucket-sizes-mb", "0.05", "1000",
]
# One worker runs them all, so the benchmark runs once per test session.
pytestmark = [pytest.mark.xdist_group("ddp-bench"), pytest.mark.timeout(600)]


def bench(tmp_path_factory) -> dict:
    if not _run:
        from scripts.bench_ddp import main

        out = tmp_path_factory.mktemp("bench") / "ddp_step.json"
        assert main([*SMOKE_ARGS, "--out", str(out)]) == 0
        data = json.loads(out.read_text())
        _run.update(data, by_variant={r["variant"]: r for r in data["records"]})
    return _run


def n_trainable() -> int:
    return sum(1 for p in TransformerLM(model_config("tiny", 16)).parameters() if p.requires_grad)


@pytest.mark.problem("naive_ddp_benchmarking")
def test_every_variant_is_timed_with_sane_figures(tmp_path_factory):
    run = bench(tmp_path_factory)
    names = [r["variant"] for r in run["records"]]
    assert names == ["compute-only", "naive", "flat", "per-parameter",
                     "bucketed-0.05MB", "bucketed-1000MB", "torch-ddp"]
    floor = run["by_variant"]["compute-only"]["step_times_s"]
    for r in run["records"]:
        assert len(r["step_times_s"]) == r["steps_timed"] == 2
        assert 0 < r["min_step_s"] <= r["median_step_s"] <= r["max_step_s"]
        # Paired by round: the median of (this variant's step i - compute-only step i).
        per_round = [mine - theirs for mine, theirs in zip(r["step_times_s"], floor)]
        assert r["exposed_overhead_s"] == pytest.approx(statistics.median(per_round))
        assert r["tokens_per_s"] == pytest.approx(4 * 16 / r["median_step_s"])
        if r["median_sync_s"] is not None:
            assert 0 <= r["median_sync_s"] <= r["max_step_s"]
    meta = run["meta"]
    for key in ("torch_version", "backend", "world_size", "git_commit", "cpu_model", "setting", "n_parameters"):
        assert key in meta
    assert meta["setting"]["model_size"] == "tiny" and meta["world_size"] == 2


@pytest.mark.problem("naive_ddp_benchmarking")
def test_naive_makes_one_call_per_parameter(tmp_path_factory):
    naive = bench(tmp_path_factory)["by_variant"]["naive"]
    assert naive["allreduce_calls_per_step"] == n_trainable() + 1  # + the usage count
    assert naive["median_sync_s"] > 0


@pytest.mark.problem("minimal_ddp_flat_benchmarking")
def test_flat_makes_one_call(tmp_path_factory):
    flat = bench(tmp_path_factory)["by_variant"]["flat"]
    assert flat["allreduce_calls_per_step"] == 1


@pytest.mark.problem("ddp_overlap_individual_parameters_benchmarking")
def test_per_parameter_makes_one_call_per_parameter(tmp_path_factory):
    per_param = bench(tmp_path_factory)["by_variant"]["per-parameter"]
    assert per_param["allreduce_calls_per_step"] == n_trainable() + 1


@pytest.mark.problem("ddp_bucketed_benchmarking")
def test_bucket_sizes_give_bucket_counts(tmp_path_factory):
    by_variant = bench(tmp_path_factory)["by_variant"]
    small, huge = by_variant["bucketed-0.05MB"], by_variant["bucketed-1000MB"]
    # The first bucket filled is capped at 1 MiB (first_bucket_mb): the tiny model's LM head
    # (64 x 10000 float32 = 2.4 MiB, first in reverse order) fills it alone; all else is one.
    assert huge["n_buckets"] == 2 and huge["allreduce_calls_per_step"] == 2
    assert 1 < small["n_buckets"] <= n_trainable()
    assert small["allreduce_calls_per_step"] == small["n_buckets"]
    assert by_variant["torch-ddp"]["allreduce_calls_per_step"] >= 1



@pytest.mark.problem("ddp_bucketed_benchmarking")
def test_rebuilding_wrappers_each_round_times_the_same_variants(tmp_path):
    """The large-model mode (one of our wrappers alive at a time) gives the same record shape:
    every round times every variant, and the bucket layout is still reported."""
    from scripts.bench_ddp import main

    out = tmp_path / "ddp_step.json"
    args = ["--model-size", "tiny", "--context-length", "16", "--global-batch", "4", "--rounds", "3",
            "--steps-per-round", "1", "--bucket-sizes-mb", "0.05", "--rebuild-each-round", "--out", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["setting"]["rebuild_each_round"] is True
    by_variant = {r["variant"]: r for r in data["records"]}
    assert all(len(r["step_times_s"]) == 3 for r in data["records"])
    assert by_variant["bucketed-0.05MB"]["allreduce_calls_per_step"] == by_variant["bucketed-0.05MB"]["n_buckets"] > 1
