"""The DDP doctor: its pure finders, the calibration's fit rule, every injected fault end to end,
and the script's exit status, flags and results file.

The end-to-end scenarios (healthy and each fault) share ONE launch of 2 ranks, since starting
ranks costs seconds here; each test then checks its scenario's report.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from cs336_basics.model import TransformerLM, model_config
from cs336_systems.ddp.auto_bucket import fit_calibration
from cs336_systems.doctor import (
    AFTER_TRAINING,
    AFTER_WRAPPING,
    BEFORE_BROADCAST,
    MISSING_RANK,
    OVERLAPPING_SHARDS,
    STRAGGLER,
    UNSEEDED,
    DoctorRun,
    DoctorSetting,
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
from cs336_systems.results.kinds import read_any
from tests.scripts_runner import run_script

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
# The all-reduce calibration's fit and its one fallback rule (cs336_systems/ddp/auto_bucket.py)

PAYLOADS = [4096, 65536, 524288, 4194304]


def test_calibration_fit_recovers_a_planted_line():
    o, w = 300e-6, 1.5e9
    fitted_o, fitted_w, r2, note = fit_calibration(PAYLOADS, [o + b / w for b in PAYLOADS])
    assert fitted_o == pytest.approx(o) and fitted_w == pytest.approx(w) and r2 == pytest.approx(1.0)
    assert note is None


def test_a_negative_intercept_is_taken_as_zero_with_a_note():
    """Times on a line through (0, -20 us): the per-call cost is below what the timings resolve."""
    w = 1e8
    o, fitted_w, r2, note = fit_calibration(PAYLOADS, [-20e-6 + b / w for b in PAYLOADS])
    assert o == 0.0 and fitted_w == pytest.approx(w) and r2 == pytest.approx(1.0)
    assert "below what the timings resolve; taken as 0" in note


def test_times_that_do_not_grow_fall_back_to_the_smallest_and_largest_payloads():
    seconds = [2e-3, 1.5e-3, 1.2e-3, 1.0e-3]  # falling with the payload: no bandwidth to fit
    o, w, r2, note = fit_calibration(PAYLOADS, seconds)
    assert r2 is None and o == seconds[0] and w == PAYLOADS[-1] / seconds[-1]
    assert "did not grow with the payload" in note


# --------------------------------------------------------------------------------------------
# End to end: the healthy run and every fault, in one launch of 2 ranks

# Noise margins for a loaded shared machine: a straggler must be 0.2 s slower than the other
# rank (the injected one sleeps 0.6 s per step), and the check-in timeout is 2 s.
E2E_SETTING = DoctorSetting(
    world_size=2,
    steps=3,
    straggler_min_excess_s=0.2,
    straggler_delay_s=0.6,
    checkin_timeout_s=2.0,
    calibration_iters=3,
)
SCENARIOS = [None, UNSEEDED, OVERLAPPING_SHARDS, STRAGGLER, MISSING_RANK]


@pytest.fixture(scope="module")
def reports():
    return dict(zip(SCENARIOS, run_doctor_scenarios(E2E_SETTING, SCENARIOS).reports))


@pytest.mark.timeout(300)
@pytest.mark.xdist_group("doctor")
def test_healthy_run_is_ok_and_suggests_a_bucket(reports):
    report = reports[None]
    assert report.findings == [] and exit_status(report) == 0, report.findings
    assert [r.rank for r in report.ranks] == [0, 1]
    assert all(r.checkin_s is not None and r.checkin_s <= E2E_SETTING.checkin_timeout_s for r in report.ranks)
    assert sum(r.samples for r in report.ranks) == E2E_SETTING.dataset_len
    model = _model(0)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    assert report.gradient_bytes == sum(sizes) and report.largest_param_bytes == max(sizes)
    o, w = report.allreduce_o_s, report.allreduce_w_bytes_per_s
    assert o is not None and o >= 0 and w is not None and w > 0
    assert [row.payload_bytes for row in report.calibration] == list(E2E_SETTING.calibration_bytes)
    s = sum(sizes)
    expected = min(max(math.sqrt(s * w * o), max(sizes)), s)
    assert report.suggested_bucket_bytes == pytest.approx(expected)
    assert all(row.correct for row in report.calibration)
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
    assert report.ranks[1].compute_s > report.ranks[0].compute_s + E2E_SETTING.straggler_delay_s / 2
    assert report.ranks[0].wait_s > E2E_SETTING.straggler_delay_s / 2  # rank 0 waits for rank 1


@pytest.mark.timeout(300)
@pytest.mark.xdist_group("doctor")
def test_missing_rank_is_named(reports):
    report = reports[MISSING_RANK]
    assert exit_status(report) == 1
    [finding] = report.findings
    assert finding.startswith("rank 1 did not check in within 2 s of rank 0")
    assert report.ranks[1].checkin_s > E2E_SETTING.checkin_timeout_s


# --------------------------------------------------------------------------------------------
# The script



@pytest.mark.timeout(300)
@pytest.mark.xdist_group("doctor")
def test_script_prints_the_findings_exits_1_and_writes_a_typed_report(reports, monkeypatch, capsys, tmp_path):
    """The script's wiring around a real report (the overlapping-shards scenario's, so that no
    second launch is needed): the table and findings printed, exit status 1, --out written."""
    import scripts.doctor as script

    run = DoctorRun([reports[OVERLAPPING_SHARDS]], rank=0, shared_gpu=False)
    monkeypatch.setattr(script, "run_doctor", lambda setting: run)
    out = tmp_path / "doctor.json"
    assert script.main(["--inject", "overlapping-shards", "--steps", "3", "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert "FOUND 1 problem" in text and "DistributedSampler shards overlap" in text
    saved = read_any(out)
    assert saved.kind == "doctor" and saved.environment.world_size == 2
    assert saved.records == [reports[OVERLAPPING_SHARDS]]  # every field survives the round trip
    assert saved.setting["inject"] == OVERLAPPING_SHARDS and saved.setting["steps"] == 3


@pytest.mark.timeout(120)
def test_script_as_the_one_rank_of_a_launcher(monkeypatch, capsys, tmp_path):
    """End to end without spawning: torchrun's variables make this process rank 0 of 1, the way
    a job started by torchrun or SLURM runs it. One rank: nothing to compare, exit status 0."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    out = tmp_path / "doctor.json"
    assert run_script(monkeypatch, SCRIPT, "--steps", "1", "--global-batch", "2", "--out", str(out)) == 0
    assert "OK: all 1 ranks checked in" in capsys.readouterr().out
    [report] = read_any(out).records
    assert report.ok and len(report.ranks) == 1 and report.calibration == [] and report.allreduce_o_s is None
    assert any(note.startswith("world size 1") for note in report.notes)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world-size", "1", "--inject", "straggler"], "needs world size > 1, got 1"),
        (["--checkin-timeout-s", "200"], "--checkin-timeout-s must be > 0 and below the process-group timeout"),
        (["--global-batch", "3"], "batch of 3 examples cannot be split evenly over world size 2"),
        (["--straggler-factor", "1"], "argument --straggler-factor: must be a number > 1"),
        (["--inject", "gremlins"], "argument --inject"),
        (["--json", "x.json"], "unrecognized arguments: --json"),  # renamed --out
    ],
)
def test_script_refuses_bad_settings_before_any_rank_starts(monkeypatch, capsys, args, message):
    assert run_script(monkeypatch, SCRIPT, *args) == 2
    captured = capsys.readouterr()
    [line] = captured.err.strip().splitlines()
    assert message in line and "Traceback" not in captured.err
