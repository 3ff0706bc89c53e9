"""The optimizer-state-sharding accounting benchmark: its counters, its flags, and one smoke run.

The smoke run (tiny model, 2 gloo ranks, both configurations in one process group) is shared by
the tests below it and read back through the typed reader. Byte counts are compared exactly,
since they are counted tensor by tensor; levels measured through RSS are compared only where the
effect (the tiny model's 5 MB of parameters, 10 MB of AdamW state) is far above RSS noise, and
loosely.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cs336_basics.model import TransformerLM, expected_parameter_count, model_config
from cs336_systems.bench.accounting import (
    CONFIGURATIONS,
    PHASES,
    AccountingRecord,
    AccountingSetting,
    communication_bytes_per_rank,
    expected_adam_state_bytes,
    live_tensor_bytes,
    optimizer_state_bytes,
    read_proc_status,
    sharded_minus_unsharded,
    storage_bytes,
)
from cs336_systems.results.kinds import read_any
from cs336_systems.zero import assign_to_ranks
from tests.scripts_runner import run_script

pytestmark = pytest.mark.problem("optimizer_state_sharding")

SCRIPT = "bench_sharded_optimizer.py"
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


def test_live_tensor_bytes_sees_a_forgotten_reference_to_parameters_and_their_gradients():
    """The leak the baselines check for: a list still holding a throwaway model's parameters
    keeps them and their gradients alive after the model itself is deleted."""
    before = live_tensor_bytes()
    model = nn.Linear(256, 512)
    model(torch.randn(4, 256)).sum().backward()
    kept = list(model.parameters())
    del model
    parameter_bytes = FP32 * (256 * 512 + 512)
    assert live_tensor_bytes() - before == 2 * parameter_bytes
    del kept
    assert live_tensor_bytes() == before


def test_expected_adam_state_follows_the_formula():
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
    assert comm.ddp_allreduce == pytest.approx(2 * share)
    assert comm.sharded_optimizer_broadcast == pytest.approx(share)
    assert comm.ddp_plus_sharded_optimizer == pytest.approx(1.5 * comm.ddp_allreduce)
    assert comm.paper_zero1 == pytest.approx(comm.ddp_allreduce)


def test_read_proc_status_converts_kib_to_bytes():
    text = "Name:\tpython\nVmPeak:\t  999 kB\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nThreads:\t3\n"
    assert read_proc_status(text) == {"VmHWM": 2048 * 1024, "VmRSS": 1024 * 1024}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(model_size="huge"), "model_size must be one of"),
        (dict(steps=0), "steps"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(bucket_size_mb=-3.0), "bucket_size_mb"),
        (dict(device="tpu"), "device"),
        (dict(global_batch=3, world_size=2), "cannot be split evenly over world size 2"),
    ],
)
def test_setting_rejects_bad_values_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AccountingSetting(**kwargs).validate()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bucket-size-mb", "-3"], "argument --bucket-size-mb: must be a number > 0"),  # issue 14: was a traceback
        (["--global-batch", "3", "--world-size", "2"], "batch of 3 examples cannot be split evenly over world size 2"),
        (["--steps", "0"], "argument --steps"),
        (["--model-size", "huge"], "argument --model-size"),
    ],
)
def test_script_refuses_bad_values_before_any_rank_starts(monkeypatch, capsys, args, message):
    assert run_script(monkeypatch, SCRIPT, *args) == 2
    captured = capsys.readouterr()
    [line] = captured.err.strip().splitlines()
    assert message in line and "Traceback" not in captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_script_refuses_cuda_without_a_gpu(monkeypatch, capsys):
    assert run_script(monkeypatch, SCRIPT, "--device", "cuda") == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err


# Smoke run ----------------------------------------------------------------------------------

SMOKE_CONTEXT = 16
SMOKE_ROUNDS = 6  # the fewest with a 95% interval for the paired difference
_run: dict = {}


def smoke(tmp_path_factory) -> dict:
    if not _run:
        from scripts.bench_sharded_optimizer import main

        out = tmp_path_factory.mktemp("sharding") / "sharded_optimizer.json"
        args = ["--model-size", "tiny", "--context-length", str(SMOKE_CONTEXT), "--world-size", "2",
                "--global-batch", "4", "--steps", str(SMOKE_ROUNDS), "--warmup-steps", "1", "--out", str(out)]
        assert main(args) == 0
        results = read_any(out)
        _run.update(results=results, by_key={(r.configuration, r.rank): r for r in results.records})
    return _run


def tiny_parameters() -> list[nn.Parameter]:
    return list(TransformerLM(model_config("tiny", SMOKE_CONTEXT)).parameters())


@pytest.mark.timeout(300)
def test_smoke_run_has_one_typed_record_per_configuration_and_rank(tmp_path_factory):
    results = smoke(tmp_path_factory)["results"]
    assert results.kind == AccountingRecord.KIND
    assert [(r.configuration, r.rank) for r in results.records] == [
        ("unsharded", 0), ("unsharded", 1), ("sharded", 0), ("sharded", 1)
    ]
    for r in results.records:
        assert isinstance(r, AccountingRecord) and r.method == "rss"
        for name in PHASES:
            phase = r.phase(name)
            if r.peak_resettable:
                assert phase.peak_above_baseline_bytes >= phase.current_above_baseline_bytes > 0
        # Paired rounds: one time per round for each configuration, the same on every rank.
        assert len(r.step_times_s) == len(r.optimizer_step_times_s) == SMOKE_ROUNDS
        assert all(0 < o < s for s, o in zip(r.step_times_s, r.optimizer_step_times_s))
    env = results.environment
    assert env.world_size == 2 and env.backend == "gloo" and env.device_type == "cpu"
    assert results.setting["model_size"] == "tiny" and results.setting["global_batch"] == 4


@pytest.mark.timeout(300)
def test_baselines_hold_nothing_of_the_warm_up_step(tmp_path_factory):
    """The regression test of the baseline leak (issue 11): the warm-up's parameters and
    gradients, kept alive by a forgotten reference, raised the unsharded baseline above the
    sharded one by about the parameter bytes (tiny: about 5 MB; cpu-small: 87 MB). Now no tensor
    is reachable at any baseline, and the RSS baselines of both configurations agree far better
    than that."""
    records = smoke(tmp_path_factory)["results"].records
    assert [r.baseline_live_tensor_bytes for r in records] == [0] * len(records)
    parameter_bytes = records[0].parameter_bytes
    baselines = [r.baseline_bytes for r in records]
    assert max(baselines) - min(baselines) < parameter_bytes / 2, baselines


@pytest.mark.timeout(300)
def test_parameters_and_gradients_are_4p_bytes_on_every_rank(tmp_path_factory):
    n_params = expected_parameter_count(model_config("tiny", SMOKE_CONTEXT))
    for r in smoke(tmp_path_factory)["results"].records:
        assert r.n_parameters == n_params and r.parameter_bytes == FP32 * n_params
        for name in ("after_model", "after_init"):
            phase = r.phase(name)
            assert phase.parameters_bytes == FP32 * n_params
            assert phase.gradients_bytes == phase.optimizer_state_bytes == 0  # AdamW's state is lazy
        for name in ("before_step", "after_step"):
            phase = r.phase(name)
            assert phase.parameters_bytes == phase.gradients_bytes == FP32 * n_params


@pytest.mark.timeout(300)
def test_unsharded_state_is_two_moments_of_every_parameter(tmp_path_factory):
    params = tiny_parameters()
    b = FP32 * sum(p.numel() for p in params)
    for rank in (0, 1):
        r = smoke(tmp_path_factory)["by_key"][("unsharded", rank)]
        assert r.expected_optimizer_state_bytes == 2 * b
        assert r.optimizer_state_bytes == 2 * b + STEP_TENSOR_BYTES * len(params)
        assert r.broadcast_received_bytes == 0


@pytest.mark.timeout(300)
def test_sharded_state_is_two_moments_of_the_owned_parameters(tmp_path_factory):
    """Owners recomputed here with the documented greedy rule; the shards add up to the whole."""
    by_key = smoke(tmp_path_factory)["by_key"]
    sizes = [FP32 * p.numel() for p in tiny_parameters()]
    b, largest = sum(sizes), max(sizes)
    owners = assign_to_ranks(sizes, 2)
    unsharded_state = by_key[("unsharded", 0)].optimizer_state_bytes
    shards = []
    for rank in (0, 1):
        r = by_key[("sharded", rank)]
        owned = [s for s, owner in zip(sizes, owners) if owner == rank]
        assert r.owned_parameters == len(owned) and r.owned_parameter_bytes == sum(owned)
        assert r.optimizer_state_bytes == 2 * sum(owned) + STEP_TENSOR_BYTES * len(owned)
        assert r.expected_optimizer_state_bytes == b  # 2B / n with n = 2
        assert r.optimizer_state_bytes <= unsharded_state / 2 + r.optimizer_state_imbalance_bound_bytes
        assert r.optimizer_state_imbalance_bound_bytes == 2 * largest
        assert r.broadcast_received_bytes == b - sum(owned)
        shards.append(r.optimizer_state_bytes)
    assert sum(shards) == unsharded_state


@pytest.mark.timeout(300)
def test_sharding_lowers_the_measured_peak_before_the_step(tmp_path_factory):
    """Before the step the state is resident; sharding it must show in the RSS peak.

    The saving is half the tiny model's 10 MB of AdamW state; demanding half of that leaves
    room for RSS noise (page granularity, the C allocator's small-block heap).
    """
    by_key = smoke(tmp_path_factory)["by_key"]
    for rank in (0, 1):
        unsharded, sharded = by_key[("unsharded", rank)], by_key[("sharded", rank)]
        saving = unsharded.optimizer_state_bytes - sharded.optimizer_state_bytes
        peak = {c: by_key[(c, rank)].before_step.peak_above_baseline_bytes for c in CONFIGURATIONS}
        assert peak["unsharded"] - peak["sharded"] >= saving / 2


@pytest.mark.timeout(300)
def test_the_paired_difference_is_the_median_of_per_round_differences(tmp_path_factory):
    records = smoke(tmp_path_factory)["results"].records
    by_key = smoke(tmp_path_factory)["by_key"]
    sharded, unsharded = by_key[("sharded", 1)].step_times_s, by_key[("unsharded", 1)].step_times_s
    differences = sorted(s - u for s, u in zip(sharded, unsharded))
    median, interval = sharded_minus_unsharded(records)
    assert median == pytest.approx((differences[2] + differences[3]) / 2)
    assert interval == (differences[0], differences[-1])  # n = 6: the 95% interval is min..max
