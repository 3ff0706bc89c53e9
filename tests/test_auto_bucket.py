"""``bucket_size_mb="auto"``: the candidates it times, the tuner's choice, ranks agreeing on it,
training unchanged while the buckets change between tuning steps, and no host wait after tuning.

The tuner is checked on planted timing functions whose best candidate we know; the collective
agreement and the training run on 2 real gloo ranks against the single-process reference of
``tests/ddp_cases.py``. To make the tuning steps change buckets on a tiny model, the rank
functions plant the overhead model's cap (the calibration's own timings would put every
candidate at one bucket for a model of a few KB).
"""

from __future__ import annotations

import math

import pytest
import torch

import cs336_systems.ddp.auto_bucket as auto_bucket
from cs336_systems.ddp.auto_bucket import (
    DEFAULT_BUCKET_BYTES,
    TUNING_ROUNDS,
    AllReduceCalibration,
    AutoBucketedDDP,
    BucketTuner,
    agree_on_cap,
    candidate_caps,
)
from cs336_systems.launch import RankContext
from cs336_basics.model import TransformerLM, model_config
from tests.ddp_cases import Case, run_ddp_cases, run_single_process
from tests.host_waits import HostWaitCounter
from tests.rank_pool import on_pool
from tests.test_ddp_host_waits import WORLD_SIZE, _lm_step, fake_group  # noqa: F401 (fixture)

pytestmark = pytest.mark.problem("beyond")

MB = 2**20
PLANTED_CALIBRATION = AllReduceCalibration((64, 128), (1e-4, 1.1e-4), (True, True), 1e-4, 1e9, 1.0)


def test_candidates_put_the_default_first_never_exceed_everything_and_drop_repeats():
    assert candidate_caps(8 * MB, 40 * MB) == [DEFAULT_BUCKET_BYTES, 8 * MB, 4 * MB, 16 * MB]
    assert candidate_caps(30 * MB, 40 * MB) == [DEFAULT_BUCKET_BYTES, 30 * MB, 15 * MB, 40 * MB]
    assert candidate_caps(25 * MB, 100 * MB) == [25 * MB, 12.5 * MB, 50 * MB]
    # A model of 2 MB: the default is one bucket of everything, and so is double the model's cap.
    assert candidate_caps(1 * MB, 2 * MB) == [2 * MB, 1 * MB, 0.5 * MB]


def test_each_round_times_every_candidate_once_in_rotated_order():
    tuner = BucketTuner([1.0, 2.0, 3.0], rounds=3)
    assert tuner.schedule == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert tuner.steps_left == 9 and not tuner.done


def planted_step_s(cap: float) -> float:
    """A step time with its minimum at 8 MB, rising by 10 ms per octave squared away from it."""
    return 0.1 + 0.01 * math.log2(cap / (8 * MB)) ** 2


def tune(caps: list[float], step_s) -> BucketTuner:
    """A tuner fed ``step_s(cap, round)`` for every scheduled step."""
    tuner = BucketTuner(caps, TUNING_ROUNDS)
    while not tuner.done:
        tuner.record(step_s(tuner.current_cap, len(tuner.local_times) // len(caps)))
    return tuner


def test_with_consistent_timings_the_tuner_keeps_the_fastest():
    caps = [25 * MB, 8 * MB, 4 * MB, 16 * MB]
    tuner = tune(caps, lambda cap, r: planted_step_s(cap) + 0.05 * r)  # drift: every round slower
    assert caps[tuner.choose(tuner.local_times)] == min(caps, key=planted_step_s) == 8 * MB
    with pytest.raises(RuntimeError, match="already recorded"):
        tuner.record(0.1)


def test_a_candidate_that_loses_one_round_to_the_default_is_not_kept():
    """8 MB is fastest by median but one slow step loses it round 0: the consistent 16 MB is kept,
    and with 16 MB gone too, the default stays."""
    caps = [25 * MB, 8 * MB, 16 * MB]
    tuner = tune(caps, lambda cap, r: planted_step_s(cap) + (1.0 if cap == 8 * MB and r == 0 else 0.0))
    assert tuner.medians(tuner.local_times)[1] < tuner.medians(tuner.local_times)[2]
    assert caps[tuner.choose(tuner.local_times)] == 16 * MB
    both_lose_once = tune(caps, lambda cap, r: planted_step_s(cap) + (1.0 if cap != 25 * MB and r == 0 else 0.0))
    assert both_lose_once.choose(both_lose_once.local_times) == 0


def test_a_tie_keeps_the_default():
    tuner = BucketTuner([25 * MB, 5 * MB], rounds=2)
    assert tuner.choose([0.2, 0.2, 0.2, 0.2]) == 0


# Per rank and round, the local time of each candidate: rank 0 alone would keep candidate 1 (it
# beats the default every round), rank 1 alone candidate 2; the slowest rank's times, step by
# step, have neither beat the default: every rank keeps the default.
AGREE_CAPS = [25 * MB, 5 * MB, 10 * MB]
LOCAL_BY_CANDIDATE = {0: [0.20, 0.10, 0.30], 1: [0.20, 0.30, 0.10]}


def local_times(rank: int) -> list[float]:
    schedule = BucketTuner(AGREE_CAPS, TUNING_ROUNDS).schedule
    return [LOCAL_BY_CANDIDATE[rank][c] for c in schedule]


AUTO_CASE = Case("bucketed[auto-tuned]-edge-sgd", "bucketed", "edge", "sgd", "auto", steps=20)
PLANTED_MODEL_CAP = 600.0  # bytes: candidates of ~4.6 KB (everything), 600, 300 and 1200 B build different buckets


def _agree_and_train(ctx: RankContext) -> dict:
    tuner = BucketTuner(AGREE_CAPS, TUNING_ROUNDS)
    for t in local_times(ctx.rank):
        tuner.record(t)
    local_choice = tuner.choose(tuner.local_times)
    agreed = agree_on_cap(tuner, ctx.device, None)
    auto_bucket.model_bucket_bytes = lambda *args, **kwargs: (PLANTED_MODEL_CAP, PLANTED_CALIBRATION)
    trained = run_ddp_cases(ctx, [AUTO_CASE])[AUTO_CASE.name]
    return {"local_choice": local_choice, "agreed": agreed, "trained": trained}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return on_pool(_agree_and_train, 2, timeout_s=120)


@pytest.mark.timeout(300)
def test_ranks_agree_on_the_slowest_ranks_choice(two_ranks):
    assert [r["local_choice"] for r in two_ranks] == [1, 2]  # alone, they would disagree
    maxima = [max(a, b) for a, b in zip(local_times(0), local_times(1))]
    expected = AGREE_CAPS[BucketTuner(AGREE_CAPS, TUNING_ROUNDS).choose(maxima)]
    assert expected == 25 * MB
    assert [r["agreed"].chosen_cap for r in two_ranks] == [expected, expected]
    assert two_ranks[0]["agreed"] == two_ranks[1]["agreed"]


@pytest.mark.timeout(300)
def test_training_matches_single_process_while_tuning_changes_the_buckets(two_ranks):
    reference = run_single_process(AUTO_CASE)
    for rank, result in enumerate(two_ranks):
        trained = result["trained"]
        assert len(set(trained["calls"])) > 1, "the tuning steps should have used different bucket layouts"
        for step, expected in enumerate(reference):
            for name, value in expected.items():
                torch.testing.assert_close(trained["history"][step][name], value, atol=AUTO_CASE.atol, rtol=1e-4,
                                           msg=lambda m: f"step {step}, rank {rank}, {name}: {m}")
    assert two_ranks[0]["trained"]["bucket_cap_bytes"] == two_ranks[1]["trained"]["bucket_cap_bytes"]


def test_after_tuning_a_step_never_waits(fake_group, monkeypatch):  # noqa: F811
    monkeypatch.setattr(auto_bucket, "model_bucket_bytes",
                        lambda *args, **kwargs: (0.5 * MB, PLANTED_CALIBRATION))
    # On the meta device a device sync does nothing, so count the wrapper's calls to it instead.
    syncs = []
    monkeypatch.setattr(auto_bucket, "sync_device", lambda device: syncs.append(device))
    with torch.device("meta"):
        module = TransformerLM(model_config("tiny"))
        tokens = torch.randint(0, module.config.vocab_size, (4, 17))
    ddp = AutoBucketedDDP(module)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    tuning_steps = 0
    while ddp.tuning:
        with HostWaitCounter(WORLD_SIZE):  # answers the reads of meta tensors; tuning steps may wait
            _lm_step(ddp, optimizer, tokens)
        tuning_steps += 1
    assert 1 + TUNING_ROUNDS * 2 <= tuning_steps <= 1 + TUNING_ROUNDS * 4  # 2 to 4 distinct layouts here
    assert ddp.tuning_result is not None and ddp.bucket_cap_bytes == ddp.tuning_result.chosen_cap
    assert len(syncs) == 2 * tuning_steps  # the clock's start and stop of each tuning step
    syncs.clear()
    counts = []
    for _ in range(2):
        with HostWaitCounter(WORLD_SIZE) as counter:
            _lm_step(ddp, optimizer, tokens)
        counts.append(dict(counter.waits))
    assert counts == [{}, {}] and syncs == []
