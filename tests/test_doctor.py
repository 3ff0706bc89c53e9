"""The DDP doctor: its pure finders, every injected fault end to end, and the script's exit status.

The end-to-end scenarios (healthy and each fault) share ONE launch of 2 ranks, since starting
ranks costs seconds here; each test then checks its scenario's report.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.scripts_runner import run_script
import torch
from torch.utils.data import DistributedSampler

from cs336_systems.doctor import (
    AFTER_TRAINING,
    AFTER_WRAPPING,
    BEFORE_BROADCAST,
    MISSING_RANK,
    OVERLAPPING_SHARDS,
    STRAGGLER,
    UNSEEDED,
    DoctorOptions,
    ParameterChecksum,
    exit_status,
    find_missing_ranks,
    find_parameter_mismatches,
    find_shard_problems,
    find_stragglers,
    format_report,
    parameter_checksums,
    run_doctor_scenarios,
)
from cs336_systems.model import TransformerLM, model_config

pytestmark = pytest.mark.problem("beyond")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "doctor.py"

# --------------------------------------------------------------------------------------------
# Shards: judged against what torch's own DistributedSampler hands out


def _shards(n: int, length: int, ranks: list[int] | None = None, **kw) -> list[list[int]]:
    """What ``DistributedSampler(num_replicas=n, rank=r)`` gives each r of ``ranks`` (default: all)."""
    ranks = ranks if ranks is not None else list(range(n))
    return [list(DistributedSampler(range(length), num_replicas=n, rank=r, **kw)) for r in ranks]


@pytest.mark.parametrize("n,length", [(2, 64), (3, 64), (4, 7), (5, 3)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_correct_samplers_have_no_shard_problems(n, length, drop_last):
    """Each rank with its own rank= (including DistributedSampler's padding or dropping)."""
    shards = _shards(n, length, drop_last=drop_last)
    assert find_shard_problems(shards, length, drop_last=drop_last) == []


def test_every_rank_as_rank_0_overlaps_and_misses_half():
    shards = _shards(2, 64, ranks=[0, 0], shuffle=False)
    [problem] = find_shard_problems(shards, 64)
    assert "shards overlap: ranks 0 and 1 both get indices [0, 2, 4, 6, 8, ...] (32 shared)" in problem
    assert "32 of 64 indices reach no rank ([1, 3, 5, 7, 9, ...])" in problem
    assert "own rank=" in problem


def test_num_replicas_one_gives_unequal_then_full_overlap():
    """Rank 1 thinks it is alone: it gets all 64 indices, rank 0 its proper 32."""
    shards = [_shards(2, 64)[0], list(DistributedSampler(range(64), num_replicas=1, rank=0))]
    problems = find_shard_problems(shards, 64)
    assert "different numbers of samples (rank 0: 32, rank 1: 64)" in problems[0]
    assert "ranks 0 and 1 both get indices" in problems[1]


def test_missing_and_out_of_range_indices():
    problems = find_shard_problems([[0, 1], [2, 9]], 5)
    assert any("outside the dataset of 5: [9]" in p for p in problems)
    assert any("shards miss data" in p and "[3, 4]" in p for p in problems)


# --------------------------------------------------------------------------------------------
# Parameters


def _model(seed: int) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(model_config("tiny"))


def test_checksum_bit_sum_matches_numpy():
    model = _model(0)
    for p, checksum in zip(model.parameters(), parameter_checksums(model)):
        expected = int(p.detach().numpy().view(np.int32).astype(np.int64).sum())
        assert checksum.bit_sum == expected
        assert math.isclose(checksum.value_sum, float(p.detach().double().sum()), rel_tol=1e-12, abs_tol=1e-12)


def test_differently_seeded_models_are_named_with_their_first_differing_parameter():
    a, b = _model(0), _model(1)
    names = [n for n, _ in a.named_parameters()]
    first = next(n for (n, p), q in zip(a.named_parameters(), b.parameters()) if not torch.equal(p, q))
    checksums = [parameter_checksums(a), parameter_checksums(b)]
    [finding] = find_parameter_mismatches(checksums, names, BEFORE_BROADCAST)
    assert "rank 1's parameters differ from rank 0's" in finding and f"(first: {first}," in finding
    assert "seeded differently" in finding and "wrap the model in DDP" in finding
    assert find_parameter_mismatches([parameter_checksums(a)] * 3, names, AFTER_WRAPPING) == []


def test_one_changed_element_is_found_and_named():
    a, b = _model(0), _model(0)
    with torch.no_grad():
        b.layers[1].ffn.w2.weight[3, 5] = torch.nextafter(b.layers[1].ffn.w2.weight[3, 5], torch.tensor(1.0))
    names = [n for n, _ in a.named_parameters()]
    ok = parameter_checksums(a)
    [finding] = find_parameter_mismatches([ok, ok, parameter_checksums(b)], names, AFTER_TRAINING)
    assert "rank 2's parameters differ from rank 0's in 1 of" in finding
    assert "(first: layers.1.ffn.w2.weight," in finding and "rank 1" not in finding
    assert "finish_gradient_synchronization()" in finding


def test_different_parameter_counts_are_reported():
    c = ParameterChecksum(1, 1.0, 1.0)
    [finding] = find_parameter_mismatches([[c, c], [c]], ["a", "b"], AFTER_WRAPPING)
    assert "different numbers of parameters" in finding and "rank 1: 1" in finding


# --------------------------------------------------------------------------------------------
# Stragglers and check-in


def test_stragglers_by_factor_and_minimum_excess():
    assert find_stragglers([0.010, 0.011, 0.100, 0.012], factor=1.5)[0].startswith("rank 2 is a straggler")
    assert len(find_stragglers([0.010, 0.011, 0.100, 0.012], factor=1.5)) == 1
    assert find_stragglers([0.010, 0.014], factor=1.5) == []  # 1.4x: within the factor
    assert find_stragglers([0.010, 0.020], factor=1.5, min_excess_s=0.02) == []  # 2x but only 10 ms
    assert find_stragglers([0.5], factor=1.5) == []  # one rank: nothing to compare with
    [busy] = find_stragglers([0.010, 0.030], factor=1.5, load_per_core=[0.2, 3.0])
    assert busy.startswith("rank 1 is a straggler") and "oversubscribed (load average 3.0 per core)" in busy
    [quiet] = find_stragglers([0.010, 0.030], factor=1.5, load_per_core=[3.0, 0.5])
    assert "oversubscribed" not in quiet


def test_missing_ranks_are_named():
    [finding] = find_missing_ranks([0.0, 0.01, 3.2, None], timeout_s=2.0)
    assert finding.startswith("ranks 2, 3 did not check in within 2 s of rank 0")
    assert "rank 2 after 3.2 s" in finding
    assert find_missing_ranks([0.0, 1.9], timeout_s=2.0) == []


# --------------------------------------------------------------------------------------------
# End to end: the healthy run and every fault, in one launch of 2 ranks

# Noise margins for a loaded shared machine: a straggler must be 0.2 s slower than the other
# rank (the injected one sleeps 0.6 s per step), and the check-in timeout is 2 s.
E2E_OPTIONS = DoctorOptions(
    world_size=2,
    timed_steps=3,
    straggler_min_excess_s=0.2,
    straggler_delay_s=0.6,
    checkin_timeout_s=2.0,
    calibration_iters=3,
)
SCENARIOS = [None, UNSEEDED, OVERLAPPING_SHARDS, STRAGGLER, MISSING_RANK]


@pytest.fixture(scope="module")
def reports():
    return dict(zip(SCENARIOS, run_doctor_scenarios(E2E_OPTIONS, SCENARIOS)))


@pytest.mark.timeout(300)
@pytest.mark.xdist_group("doctor")
def test_healthy_run_is_ok_and_suggests_a_bucket(reports):
    report = reports[None]
    assert report.findings == [] and exit_status(report) == 0, report.findings
    assert [r.rank for r in report.ranks] == [0, 1]
    assert all(r.checkin_s is not None and r.checkin_s <= E2E_OPTIONS.checkin_timeout_s for r in report.ranks)
    assert sum(r.samples for r in report.ranks) == E2E_OPTIONS.dataset_len
    model = _model(0)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    assert report.gradient_bytes == sum(sizes) and report.largest_param_bytes == max(sizes)
    o, w = report.allreduce_o_s, report.allreduce_w_bytes_per_s
    assert o is not None and w is not None and w > 0 and report.fit_r2 is not None
    s = sum(sizes)
    expected = min(max(math.sqrt(s * w * max(o, 0.0)), max(sizes)), s)
    assert report.suggested_bucket_bytes == pytest.approx(expected)
    assert all(row["correct"] for row in report.calibration)
    text = format_report(report)
    assert "OK:" in text and "suggested bucket" in text and "o = " in text


@pytest.mark.timeout(300)
@pytest.mark.xdist_group("doctor")
def test_unseeded_ranks_without_broadcast_are_named(reports):
    report = reports[UNSEEDED]
    assert exit_status(report) == 1
    [finding] = report.findings  # later stages inherit the difference and are not repeated
    assert "rank 1's parameters differ from rank 0's" in finding
    assert "(first: token_embeddings.weight," in finding and BEFORE_BROADCAST in finding
    assert "seeded differently" in finding


@pytest.mark.timeout(300)
@pytest.mark.xdist_group("doctor")
def test_overlapping_shards_are_found(reports):
    report = reports[OVERLAPPING_SHARDS]
    assert exit_status(report) == 1
    [finding] = report.findings
    assert "shards overlap: ranks 0 and 1 both get indices" in finding and "(32 shared)" in finding


@pytest.mark.timeout(300)
@pytest.mark.xdist_group("doctor")
def test_straggler_is_named(reports):
    report = reports[STRAGGLER]
    assert exit_status(report) == 1
    [finding] = report.findings
    assert finding.startswith("rank 1 is a straggler")
    assert report.ranks[1].compute_s > report.ranks[0].compute_s + E2E_OPTIONS.straggler_delay_s / 2
    assert report.ranks[0].wait_s > E2E_OPTIONS.straggler_delay_s / 2  # rank 0 waits for rank 1


@pytest.mark.timeout(300)
@pytest.mark.xdist_group("doctor")
def test_missing_rank_is_named(reports):
    report = reports[MISSING_RANK]
    assert exit_status(report) == 1
    [finding] = report.findings
    assert finding.startswith("rank 1 did not check in within 2 s of rank 0")
    assert report.ranks[1].checkin_s > E2E_OPTIONS.checkin_timeout_s


# --------------------------------------------------------------------------------------------
# The script



@pytest.mark.timeout(300)
def test_script_exits_nonzero_on_overlapping_shards(monkeypatch, capsys, tmp_path):
    out = tmp_path / "doctor.json"
    assert run_script(monkeypatch, SCRIPT, "--inject", "overlapping-shards", "--steps", "1", "--json", str(out)) == 1
    text = capsys.readouterr().out
    assert "FOUND 1 problem" in text and "DistributedSampler shards overlap" in text
    saved = json.loads(out.read_text())
    assert saved["ok"] is False and saved["inject"] == OVERLAPPING_SHARDS and len(saved["ranks"]) == 2


def test_script_refuses_a_fault_on_a_rank_that_does_not_exist(monkeypatch, capsys):
    assert run_script(monkeypatch, SCRIPT, "--world-size", "1", "--inject", "straggler") == 2
    assert "needs world size > 1, got 1" in capsys.readouterr().err
