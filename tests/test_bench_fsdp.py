"""The FSDP step benchmark: one smoke run of scripts/bench_fsdp.py, and its parts without ranks.

The smoke run (tiny model, context 32, 2 gloo ranks, 2 rounds of one step) must time every
configuration in every round and count, for each, the bytes its collectives move and the
memory it holds, against references computed here from the model's own parameter sizes: DDP
all-reduces every gradient once; ZeRO-1 also broadcasts every parameter; our FSDP gathers every
sharded weight for forward and all but the embedding again for backward (an embedding's
backward needs its input, not its weight), reduce-scatters each weight's gradient once and
all-reduces the replicated gains; AdamW keeps two float32 moments per parameter element and a
float32 step per parameter tensor. The counting mode and the formulas are also checked alone.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import scripts.bench_fsdp as bench_fsdp
from cs336_basics.model import MODEL_SIZES, Embedding, Linear, TransformerLM, expected_parameter_count, model_config
from cs336_systems.bench.fsdp.accounting import StepAccounting
from cs336_systems.bench.fsdp.configurations import CONFIGURATIONS, Configuration
from cs336_systems.bench.fsdp.formulas import (
    DDP,
    FSDP,
    TORCH_FSDP,
    ZERO1,
    formula_traffic_bytes,
    largest_model_size,
    largest_parameters,
    traffic_bytes,
)
from cs336_systems.bench.fsdp.record import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE_SCATTER, FsdpStepRecord
from cs336_systems.results.kinds import read_any

from .script_checks import interrupted_run_writes_nothing, must_not_start, refused_in_one_line

pytestmark = pytest.mark.problem("fsdp")
CONTEXT, BATCH, ROUNDS = 32, 4, 2
SMOKE_ARGS = ["--model-size", "tiny", "--context-length", str(CONTEXT), "--global-batch", str(BATCH),
              "--rounds", str(ROUNDS), "--steps-per-round", "1", "--warmup-steps", "1"]
_run: dict = {}


def smoke(test):
    """A test of the smoke run: one worker runs them all, so the benchmark runs once per session."""
    return pytest.mark.xdist_group("fsdp-bench")(pytest.mark.timeout(300)(test))


def records(tmp_path_factory) -> dict[str, FsdpStepRecord]:
    if not _run:
        out = tmp_path_factory.mktemp("bench") / "fsdp_step.json"
        assert bench_fsdp.main([*SMOKE_ARGS, "--out", str(out)]) == 0
        _run["results"] = read_any(out)
    return {r.configuration: r for r in _run["results"].records}


def sizes() -> dict[str, int]:
    """Bytes of the tiny model's parts, from the model itself."""
    model = TransformerLM(model_config("tiny", CONTEXT))
    sharded = [m.weight for m in model.modules() if isinstance(m, (Linear, Embedding))]
    return {
        "params": sum(p.numel() * 4 for p in model.parameters()),
        "sharded": sum(w.numel() * 4 for w in sharded),
        "embedding": model.token_embeddings.weight.numel() * 4,
        "buffers": sum(b.numel() * b.element_size() for b in model.buffers()),
        "tensors": len(list(model.parameters())),
        "elements_even": all(w.numel() % 2 == 0 for w in sharded),
    }


@smoke
def test_every_configuration_is_timed_every_round_and_compared_with_ours(tmp_path_factory):
    by_name = records(tmp_path_factory)
    assert list(by_name) == list(CONFIGURATIONS)
    for r in by_name.values():
        assert len(r.step_times_s) == r.steps_timed == ROUNDS
        assert 0 < r.min_step_s <= r.median_step_s <= r.max_step_s
        assert r.tokens_per_s == pytest.approx(BATCH * CONTEXT / r.median_step_s)
        if r.configuration == FSDP:
            assert r.vs_fsdp_s is None
        else:  # the median of the per-round differences: two rounds, their mean
            ours = by_name[FSDP].step_times_s
            assert r.vs_fsdp_s == pytest.approx(sum(a - b for a, b in zip(r.step_times_s, ours)) / ROUNDS)
    assert _run["results"].environment.world_size == 2
    # The mode timed is the one adapters.get_fsdp builds (test_fsdp_ours checks get_fsdp's mode).
    assert by_name[FSDP].fsdp_mode == "reduce-scatter"
    assert all(r.fsdp_mode is None for name, r in by_name.items() if name != FSDP)


@smoke
def test_collective_bytes_match_the_model(tmp_path_factory):
    by_name, s = records(tmp_path_factory), sizes()
    assert s["elements_even"]  # so shards of 2 ranks need no padding and the sums are exact
    ddp, zero1, ours, torch_fsdp = (by_name[n] for n in (DDP, ZERO1, FSDP, TORCH_FSDP))
    # Bucketed DDP: every gradient (and one flag per parameter saying whether it had one) in
    # the buckets' all-reduces; rank 0's buffers broadcast before forward.
    assert s["params"] <= ddp.payload_bytes[ALL_REDUCE] <= s["params"] + 4 * s["tensors"]
    assert ddp.payload_bytes[BROADCAST] == s["buffers"]
    assert zero1.payload_bytes[ALL_REDUCE] == ddp.payload_bytes[ALL_REDUCE]
    assert zero1.payload_bytes[BROADCAST] == s["params"] + s["buffers"]
    assert ours.payload_bytes == {
        ALL_GATHER: 2 * s["sharded"] - s["embedding"],
        REDUCE_SCATTER: s["sharded"],
        ALL_REDUCE: s["params"] - s["sharded"],
    }
    assert torch_fsdp.payload_bytes[REDUCE_SCATTER] == s["params"]  # it shards the gains too
    assert s["params"] <= torch_fsdp.payload_bytes[ALL_GATHER] <= 2 * s["params"]
    for r in by_name.values():
        assert r.traffic_bytes == pytest.approx(traffic_bytes(r.payload_bytes, 2))
        assert r.formula_traffic_bytes == pytest.approx(formula_traffic_bytes(r.configuration, s["params"], 2))


@smoke
def test_memory_parts_match_the_model_and_sharding_saves_memory(tmp_path_factory):
    by_name, s = records(tmp_path_factory), sizes()
    ddp, zero1, ours = by_name[DDP], by_name[ZERO1], by_name[FSDP]
    adam = 2 * s["params"] + 4 * s["tensors"]  # two moments per element, a step per tensor
    assert ddp.peak_optimizer_state_bytes == adam
    assert ddp.peak_parameters_bytes == s["params"] + s["buffers"]
    assert ddp.peak_gradients_bytes >= s["params"]  # the buckets hold every gradient, always
    replicated = s["params"] - s["sharded"]
    assert ours.peak_optimizer_state_bytes == 2 * (s["sharded"] // 2 + replicated) + 4 * s["tensors"]
    assert zero1.peak_optimizer_state_bytes < adam
    for r in by_name.values():
        assert sum(r.peak_parts.values()) == r.peak_bytes
        assert r.resident_bytes <= r.peak_bytes and r.allocator_peak_bytes is None  # a CPU run
        assert r.bytes_per_parameter == pytest.approx(
            (r.peak_parameters_bytes + r.peak_gradients_bytes + r.peak_optimizer_state_bytes) / r.n_parameters)
        assert r.largest_parameters == pytest.approx(
            largest_parameters(r.bytes_per_parameter, r.peak_activations_bytes, r.free_bytes_per_rank))
    assert ours.peak_bytes < ddp.peak_bytes and ours.resident_bytes < zero1.resident_bytes < ddp.resident_bytes


@smoke
def test_our_fsdp_timeline_reduces_during_backward(tmp_path_factory):
    by_name = records(tmp_path_factory)
    assert by_name[DDP].timeline is None and by_name[TORCH_FSDP].timeline is not None
    timeline = by_name[FSDP].timeline
    phases = timeline.phases
    assert [phases[p][0] <= phases[p][1] for p in ("forward", "backward", "finish", "optimizer_step")] == [True] * 4
    assert phases["forward"][1] <= phases["backward"][0] <= phases["backward"][1] <= timeline.duration_s
    # Our FSDP moves a block's weights together (cs336_systems/fsdp/unit.py): one unit per
    # block, and one each for the embedding and the LM head, which sit outside the blocks.
    model = TransformerLM(model_config("tiny", CONTEXT))
    outside = [m for m in model.children() if isinstance(m, (Linear, Embedding))]
    units = len(model.layers) + len(outside)
    assert len(outside) == 2
    assert len(timeline.collectives[REDUCE_SCATTER]) == units
    assert len(timeline.collectives[ALL_GATHER]) == 2 * units - 1  # the embedding's not again
    backward = phases["backward"]
    for launched, done in timeline.collectives[REDUCE_SCATTER]:
        assert backward[0] <= launched <= backward[1] and launched <= done <= timeline.duration_s
    for start, end in timeline.compute:
        assert 0 <= start <= end <= timeline.duration_s


# -- the parts, without ranks ----------------------------------------------------------------


def test_counting_follows_allocations_frees_and_shrunk_storages():
    layer = nn.Linear(16, 8, bias=False)
    config = Configuration("probe", layer, layer, torch.optim.SGD(layer.parameters(), lr=0.1), None)
    accounting = StepAccounting(config)
    weight = 16 * 8 * 4
    assert accounting.resident_bytes == accounting.peak_bytes == weight
    with accounting:
        a = torch.empty(1000)
        gathered = torch.empty(3000)
        gathered.untyped_storage().resize_(0)  # freed in place, as both FSDPs free a weight
        b = torch.empty(3500)  # the peak: a and b; it would be higher were the shrunk one counted
        del a
        c = torch.empty(10)
    assert accounting.peak_bytes == weight + 4 * (1000 + 3500)
    assert accounting.peak_parts == {"parameters": weight, "gradients": 0, "optimizer_state": 0,
                                     "activations": 4 * 4500}
    assert b.numel() + c.numel() == 3510  # alive to the end


def test_formulas_move_one_and_a_half_times_ddp_for_fsdp_and_zero1():
    for n in (2, 3, 8):
        ddp = formula_traffic_bytes(DDP, 1000.0, n)
        assert ddp == pytest.approx(2 * (n - 1) / n * 1000)
        for name in (ZERO1, FSDP, TORCH_FSDP):
            assert formula_traffic_bytes(name, 1000.0, n) == pytest.approx(1.5 * ddp)
    assert traffic_bytes({ALL_GATHER: 100.0, REDUCE_SCATTER: 50.0, ALL_REDUCE: 10.0, BROADCAST: 40.0}, 4) == \
        pytest.approx(0.75 * 100 + 0.75 * 50 + 1.5 * 10 + 0.75 * 40)
    with pytest.raises(ValueError, match="unknown configuration"):
        formula_traffic_bytes("zero3", 1.0, 2)


def test_the_largest_model_is_computed_from_free_memory():
    assert largest_parameters(16.0, 1000.0, 17_000.0) == pytest.approx(1000.0)
    assert largest_parameters(16.0, 2000.0, 1000.0) == 0.0
    counts = {name: expected_parameter_count(config) for name, config in MODEL_SIZES.items()}
    assert largest_model_size(counts["medium"]) == "medium"
    assert largest_model_size(counts["medium"] - 1) == max((c, n) for n, c in counts.items()
                                                          if c < counts["medium"])[1]
    assert largest_model_size(min(counts.values()) - 1) is None


def test_an_impossible_setting_is_refused_before_any_rank_starts(monkeypatch, capsys):
    must_not_start(monkeypatch, bench_fsdp, "run_fsdp_benchmark")
    line = refused_in_one_line(bench_fsdp.main, ["--global-batch", "3", "--world-size", "2"], capsys)
    assert "cannot be split evenly over world size 2" in line


def test_an_interrupted_run_writes_nothing(monkeypatch, tmp_path, capsys):
    interrupted_run_writes_nothing(monkeypatch, bench_fsdp, "run_fsdp_benchmark", tmp_path / "fsdp_step.json", capsys)
