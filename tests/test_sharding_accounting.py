"""The optimizer-state-sharding accounting benchmark: its helpers, and one smoke run of the script.

The smoke run (tiny model, 2 gloo ranks, one launch per configuration) is shared by the tests
below it. Byte counts are compared exactly, since they are counted tensor by tensor; the memory
levels measured through RSS are compared only where the effect (the tiny model's 5 MiB of
optimizer state) is far above RSS noise, and loosely.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from cs336_systems.model import TransformerLM, expected_parameter_count, model_config
from cs336_systems.sharded_optimizer import assign_to_ranks
from cs336_systems.sharding_accounting import (
    PHASES,
    ShardingAccountingSetting,
    communication_bytes_per_rank,
    expected_adam_state_bytes,
    optimizer_state_bytes,
    read_proc_status,
    storage_bytes,
)

pytestmark = pytest.mark.problem("optimizer_state_sharding")

FP32 = 4
# AdamW keeps a 0-dim float32 ``step`` tensor per parameter beside its two moments
# (torch/optim/adamw.py, _init_group), unless the default dtype is float64.
STEP_TENSOR_BYTES = 4


# Pure helpers -------------------------------------------------------------------------------


def test_storage_bytes_counts_each_storage_once():
    base = torch.zeros(10, 4)
    other = torch.ones(3, dtype=torch.float64)
    assert storage_bytes([base, base[2:5], base.view(40), None, other]) == 10 * 4 * 4 + 3 * 8
    assert storage_bytes([]) == 0
    assert storage_bytes([torch.empty(0)]) == 0


def test_optimizer_state_bytes_is_two_moments_and_a_step_per_parameter():
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 3, bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert optimizer_state_bytes(optimizer) == 0  # AdamW creates its state at the first step
    model(torch.randn(5, 8)).sum().backward()
    optimizer.step()
    params = list(model.parameters())
    n_scalars = sum(p.numel() for p in params)
    assert optimizer_state_bytes(optimizer) == 2 * FP32 * n_scalars + STEP_TENSOR_BYTES * len(params)


def test_expected_adam_state_follows_the_docstring_formula():
    n_params = 1_000
    parameter_bytes = FP32 * n_params
    assert expected_adam_state_bytes(parameter_bytes, 4, sharded=False) == 8 * n_params
    assert expected_adam_state_bytes(parameter_bytes, 4, sharded=True) == 8 * n_params / 4
    assert expected_adam_state_bytes(parameter_bytes, 1, sharded=True) == 8 * n_params
    with pytest.raises(ValueError, match="world_size"):
        expected_adam_state_bytes(parameter_bytes, 0, sharded=True)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_communication_volumes(world_size):
    b = 1_000_000
    comm = communication_bytes_per_rank(b, world_size)
    # Ring all-reduce: reduce-scatter then all-gather, each moving (n-1)/n of the payload.
    share = b * (world_size - 1) / world_size
    assert comm["ddp_allreduce"] == pytest.approx(2 * share)
    assert comm["sharded_optimizer_broadcast"] == pytest.approx(share)
    assert comm["ddp_plus_sharded_optimizer"] == pytest.approx(1.5 * comm["ddp_allreduce"])
    assert comm["paper_zero1"] == pytest.approx(comm["ddp_allreduce"])


def test_read_proc_status_converts_kib_to_bytes():
    text = "Name:\tpython\nVmPeak:\t  999 kB\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nThreads:\t3\n"
    assert read_proc_status(text) == {"VmHWM": 2048 * 1024, "VmRSS": 1024 * 1024}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(model_size="huge"), "model size"),
        (dict(world_size=0), "world_size"),
        (dict(steps=0), "steps"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(device_type="tpu"), "device_type"),
        (dict(configurations=("zero3",)), "configurations"),
    ],
)
def test_setting_rejects_bad_values_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ShardingAccountingSetting(**kwargs)


# Smoke run ----------------------------------------------------------------------------------

SMOKE_CONTEXT = 16
SMOKE_STEPS = 2
_run: dict = {}


def smoke(tmp_path_factory) -> dict:
    if not _run:
        from scripts.bench_sharded_optimizer import main

        out = tmp_path_factory.mktemp("sharding") / "sharded_optimizer.json"
        args = ["--model-size", "tiny", "--context-length", str(SMOKE_CONTEXT), "--world-size", "2",
                "--steps", str(SMOKE_STEPS), "--warmup-steps", "1", "--out", str(out)]
        assert main(args) == 0
        data = json.loads(out.read_text())
        _run.update(data, by_key={(r["configuration"], r["rank"]): r for r in data["records"]})
    return _run


def tiny_parameters() -> list[nn.Parameter]:
    return list(TransformerLM(model_config("tiny", SMOKE_CONTEXT)).parameters())


@pytest.mark.timeout(300)
def test_smoke_run_has_one_sane_record_per_configuration_and_rank(tmp_path_factory):
    run = smoke(tmp_path_factory)
    assert [(r["configuration"], r["rank"]) for r in run["records"]] == [
        ("unsharded", 0), ("unsharded", 1), ("sharded", 0), ("sharded", 1)
    ]
    for r in run["records"]:
        assert r["method"] == "rss" and r["fresh_process"] is True
        assert set(r["phases"]) == set(PHASES)
        for phase in r["phases"].values():
            assert set(phase["breakdown"]) == {"parameters", "gradients", "optimizer_state", "other"}
            assert phase["peak_bytes"] >= phase["current_bytes"] > 0 or not r["peak_resettable"]
        assert len(r["step_times_s"]) == len(r["optimizer_step_times_s"]) == SMOKE_STEPS
        assert all(t > 0 for t in r["step_times_s"] + r["optimizer_step_times_s"])
        assert 0 < r["median_optimizer_step_s"] < r["median_step_s"]
    meta = run["meta"]
    for key in ("torch_version", "backend", "world_size", "git_commit", "setting", "n_parameters"):
        assert key in meta
    assert meta["memory_method"] == "rss" and meta["setting"]["model_size"] == "tiny"


@pytest.mark.timeout(300)
def test_parameters_and_gradients_are_4p_bytes_on_every_rank(tmp_path_factory):
    n_params = expected_parameter_count(model_config("tiny", SMOKE_CONTEXT))
    for r in smoke(tmp_path_factory)["records"]:
        assert r["n_parameters"] == n_params and r["parameter_bytes"] == FP32 * n_params
        init = r["phases"]["after_init"]["breakdown"]
        assert init["parameters"] == FP32 * n_params
        assert init["gradients"] == init["optimizer_state"] == 0  # AdamW's state is lazy
        for phase in ("before_step", "after_step"):
            breakdown = r["phases"][phase]["breakdown"]
            assert breakdown["parameters"] == breakdown["gradients"] == FP32 * n_params


@pytest.mark.timeout(300)
def test_unsharded_state_is_two_moments_of_every_parameter(tmp_path_factory):
    params = tiny_parameters()
    b = FP32 * sum(p.numel() for p in params)
    for rank in (0, 1):
        r = smoke(tmp_path_factory)["by_key"][("unsharded", rank)]
        assert r["expected_optimizer_state_bytes"] == 2 * b
        assert r["measured_optimizer_state_bytes"] == 2 * b + STEP_TENSOR_BYTES * len(params)


@pytest.mark.timeout(300)
def test_sharded_state_is_two_moments_of_the_owned_parameters(tmp_path_factory):
    """Owners recomputed here with the documented greedy rule; the shards add up to the whole."""
    run = smoke(tmp_path_factory)
    params = tiny_parameters()
    sizes = [FP32 * p.numel() for p in params]
    b, largest = sum(sizes), max(sizes)
    owners = assign_to_ranks(sizes, 2)
    unsharded_state = run["by_key"][("unsharded", 0)]["measured_optimizer_state_bytes"]
    shards = []
    for rank in (0, 1):
        r = run["by_key"][("sharded", rank)]
        owned = [s for s, owner in zip(sizes, owners) if owner == rank]
        assert r["owned_parameters"] == len(owned) and r["owned_parameter_bytes"] == sum(owned)
        state = r["measured_optimizer_state_bytes"]
        assert state == 2 * sum(owned) + STEP_TENSOR_BYTES * len(owned)
        assert r["expected_optimizer_state_bytes"] == b  # 2B / n with n = 2
        assert state <= unsharded_state / 2 + 2 * largest
        assert r["communication_bytes_per_rank"]["parameter_broadcast"] == b / 2
        assert r["communication_bytes_per_rank"]["parameter_broadcast_received"] == b - sum(owned)
        shards.append(state)
    assert sum(shards) == unsharded_state


@pytest.mark.timeout(300)
def test_sharding_lowers_the_measured_peak_before_the_step(tmp_path_factory):
    """Before the step the state is resident; sharding it must show in the RSS peak.

    The saving is half the tiny model's 10 MiB of AdamW state; demanding half of that leaves
    room for RSS noise (page granularity, the C allocator's small-block heap).
    """
    by_key = smoke(tmp_path_factory)["by_key"]
    for rank in (0, 1):
        unsharded, sharded = by_key[("unsharded", rank)], by_key[("sharded", rank)]
        saving = unsharded["measured_optimizer_state_bytes"] - sharded["measured_optimizer_state_bytes"]
        peak = {k: r["phases"]["before_step"]["peak_above_baseline_bytes"] for k, r in
                (("unsharded", unsharded), ("sharded", sharded))}
        assert peak["unsharded"] - peak["sharded"] >= saving / 2
