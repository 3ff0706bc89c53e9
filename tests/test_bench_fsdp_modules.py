"""The FSDP modules benchmark: one smoke run of scripts/bench_fsdp_modules.py at the tests' shape.

Two gloo ranks, the six cases of cs336_systems/bench/fsdp/modules.py on both sides, 6 rounds (the
fewest that give a 95% interval). The run must time both sides of every case in every round,
read each round's ratio from those times, count bytes held that match the model's own parameter
sizes (shards, gradients, AdamW's two moments, each within padding of a 1/2 share of the model),
and end with both sides' weights together. A refused setting starts nothing.
"""

from __future__ import annotations

import statistics

import pytest

import scripts.bench_fsdp_modules as bench
from cs336_systems.bench.fsdp.modules import CASES, TEST_SHAPE, build
from cs336_systems.bench.stats import median_interval
from cs336_systems.results.kinds import read_any

from .script_checks import must_not_start, refused_in_one_line

pytestmark = [pytest.mark.problem("fsdp"), pytest.mark.xdist_group("fsdp-modules-bench"), pytest.mark.timeout(300)]
ROUNDS = 6
ARGS = ["--d-model", str(TEST_SHAPE.d_model), "--num-heads", str(TEST_SHAPE.num_heads), "--d-ff", str(TEST_SHAPE.d_ff),
        "--num-layers", str(TEST_SHAPE.num_layers), "--vocab-size", str(TEST_SHAPE.vocab_size), "--context-length", "5",
        "--global-batch", "6", "--rounds", str(ROUNDS), "--world-size", "2"]
_run: dict = {}


def records(tmp_path_factory) -> dict:
    if not _run:
        out = tmp_path_factory.mktemp("bench") / "fsdp_modules.json"
        assert bench.main([*ARGS, "--out", str(out)]) == 0
        _run["results"] = read_any(out)
    return {r.case: r for r in _run["results"].records}


def test_every_case_timed_on_both_sides_every_round_and_read_by_round(tmp_path_factory):
    by_case = records(tmp_path_factory)
    assert list(by_case) == [c.name for c in CASES]
    for r in by_case.values():
        assert len(r.ours_step_times_s) == len(r.torch_step_times_s) == ROUNDS and r.world_size == 2
        ratios = [a / b for a, b in zip(r.ours_step_times_s, r.torch_step_times_s)]
        assert r.ratio_median == pytest.approx(statistics.median(ratios))
        assert r.ratio_ci95 == pytest.approx(list(median_interval(ratios)))


def test_bytes_held_are_a_share_of_the_model_and_weights_end_together(tmp_path_factory):
    for case in CASES:
        r = records(tmp_path_factory)[case.name]
        model = build(case, TEST_SHAPE)
        assert r.n_parameters == sum(p.numel() for p in model.parameters())
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # Half of every parameter (float32), and of each trained one's gradient and two moments,
        # plus padding (under one element per rank and tensor) and AdamW's step counts.
        share = 4 * (r.n_parameters + 3 * trained) / 2
        for held in (r.ours_resident_bytes, r.torch_resident_bytes):
            assert share <= held <= share * 1.1, f"{case.name}: {held} B held, a half share is {share} B"
        assert r.ours_peak_bytes >= r.ours_resident_bytes and r.torch_peak_bytes >= r.torch_resident_bytes
        # The float32 tolerance of tests/test_fsdp_any_module.py; bf16 sides compute alike too.
        assert r.max_weight_difference <= 1e-5, f"{case.name}: weights {r.max_weight_difference:.3g} apart"


def test_heads_that_do_not_divide_the_width_are_refused_before_any_rank(monkeypatch, capsys):
    must_not_start(monkeypatch, bench, "run_fsdp_modules_benchmark")
    line = refused_in_one_line(bench.main, ["--d-model", "10", "--num-heads", "4"], capsys)
    assert "--num-heads 4 does not divide --d-model 10" in line
