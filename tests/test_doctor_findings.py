"""The DDP doctor's pure parts: its finders, judged against torch's own DistributedSampler and
against models that differ in known places, and the calibration's fit and fallback rule."""

from __future__ import annotations

import math

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
    ParameterChecksum,
    find_missing_ranks,
    find_parameter_mismatches,
    find_shard_problems,
    find_stragglers,
    parameter_checksums,
)

pytestmark = pytest.mark.problem("beyond")

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


def tiny_model(seed: int) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(model_config("tiny"))


def test_checksum_bit_sum_matches_numpy():
    model = tiny_model(0)
    for p, checksum in zip(model.parameters(), parameter_checksums(model)):
        expected = int(p.detach().numpy().view(np.int32).astype(np.int64).sum())
        assert checksum.bit_sum == expected
        assert math.isclose(checksum.value_sum, float(p.detach().double().sum()), rel_tol=1e-12, abs_tol=1e-12)


def test_differently_seeded_models_are_named_with_their_first_differing_parameter():
    a, b = tiny_model(0), tiny_model(1)
    names = [n for n, _ in a.named_parameters()]
    first = next(n for (n, p), q in zip(a.named_parameters(), b.parameters()) if not torch.equal(p, q))
    checksums = [parameter_checksums(a), parameter_checksums(b)]
    [finding] = find_parameter_mismatches(checksums, names, BEFORE_BROADCAST)
    assert "rank 1's parameters differ from rank 0's" in finding and f"(first: {first}," in finding
    assert "seeded differently" in finding and "wrap the model in DDP" in finding
    assert find_parameter_mismatches([parameter_checksums(a)] * 3, names, AFTER_WRAPPING) == []


def test_one_changed_element_is_found_and_named():
    a, b = tiny_model(0), tiny_model(0)
    with torch.no_grad():
        b.layers[1].ffn.w2.weight[3, 5] = torch.nextafter(b.layers[1].ffn.w2.weight[3, 5], torch.tensor(1.0))
    names = [n for n, _ in a.named_parameters()]
    ok = parameter_checksums(a)
    [finding] = find_parameter_mismatches([ok, ok, parameter_checksums(b)], names, AFTER_TRAINING)
    assert "rank 2's parameters differ from rank 0's in 1 of" in finding
    assert "(first: layers.1.ffn.w2.weight," in finding and "rank 1" not in finding
    assert "not averaged over all ranks" in finding


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
# The in-job doctor's report when a rank never arrives (doctor/job_findings.py)


def test_a_missing_rank_is_named_with_what_it_last_did():
    from cs336_systems.doctor.exchange import Progress
    from cs336_systems.doctor.job_findings import RankObservation, find_missing_at_report

    arrived = RankObservation(1, 2, "gloo", "h", "cpu", batches=2, optimizer_steps=2)
    [skipped] = find_missing_at_report([arrived], {0: Progress(3, 2, "started batch 3")}, 30.0)
    assert skipped.startswith("rank 0 did not reach report() within 30 s (last seen: rank 0: started batch 3")
    assert "Rank 1 ran fewer iterations than rank 0 started" in skipped
    # The missing rank is behind, or never wrote: slower or stuck, not a skipped iteration.
    [slow] = find_missing_at_report([arrived], {0: Progress(1, 1, "started batch 1")}, 30.0)
    assert "Rank 0 is slower or stuck" in slow and "report_timeout_s" in slow
    [silent] = find_missing_at_report([arrived], {0: None}, 30.0)
    assert "rank 0: no batch yet" in silent
