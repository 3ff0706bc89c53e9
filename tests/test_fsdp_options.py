"""Each FSDP option against torch's ``fully_shard`` (FSDP2) configured the same way.

One spawned process group per world size (2 and 3; 4 = 2 x 2 for hybrid sharding) trains every
option on both sides from the same weights and data (tests/fsdp_options_cases.py; the sides are
built by cs336_systems/bench/fsdp/options.py, which the benchmark times), and the single-process
reference trains the same model on the whole batch here. Checked per option:

* weights after every step: equal to torch's in float32 within the rounding of a different
  summation order (bitwise at world size 2 and 4, where a sum of two partials has one order;
  ~1 ulp at 3), and to single-process whole-batch training within float32 rounding, which
  makes the accumulation and checkpointing claims (one large batch; un-checkpointed results)
  exact statements about the arithmetic; in bfloat16 compute, within bfloat16 rounding of
  torch's, and no further from float32 training than torch's is;
* bytes held per rank between steps within 5% of torch's, and the step's peak no higher than
  5% above torch's;
* collectives per step, by what the option changes: no second all-gather without resharding,
  no reduce-scatter inside ``no_sync``, one reduce-scatter per unit per accumulated step,
  gradients reduced in the reduce dtype's bytes, an all-reduce across replicas;
* activation checkpointing: results equal to the un-checkpointed run bitwise, and the peak of
  activation bytes lower (measured by the benchmark's counting mode).

``FSDP_OPTIONS_EXHAUSTIVE=1`` adds every option at world size 4 but accumulation (whose 6 rows per
rank do not split into 4 micro-batches): about 80 s more here.
"""

from __future__ import annotations

import os

import pytest
import torch

from cs336_systems.bench.fsdp.options import SPECS
from cs336_systems.fsdp import FullyShardedDataParallel
from cs336_systems.launch import launch
from tests.rank_pool import POOLED_WORLD_SIZES, on_pool
from tests.fsdp_options_cases import BATCH, DEPTH, build_model, run_option_cases, train_reference

# A run takes about 30 s alone here, and 5-10 times that at a load of 10-20 on 2 cores: a 300 s
# wall-clock bound failed there once (issue 47) while the run was progressing. A hang is bounded
# by the process group's 240 s collective timeout and by the launcher's JOIN_S deadline instead,
# both of which end the ranks with a message before pytest's bound.
JOIN_S = 840
pytestmark = [pytest.mark.problem("fsdp"), pytest.mark.timeout(JOIN_S + 60)]

EXHAUSTIVE = os.environ.get("FSDP_OPTIONS_EXHAUSTIVE") == "1"
# Our units (cs336_systems/fsdp/unit.py): each block's two weights together, the embedding, the
# head; each unit takes one all-gather and one reduce-scatter.
N_UNITS = DEPTH + 2
N_TORCH_GROUPS = DEPTH + 1  # fully_shard on each block and on the model
FLOAT32_ATOL = 1e-6  # measured: at most 1.2e-7 (1 ulp of |p| <= 1) after three steps
BF16_ATOL = 1e-3  # measured: at most 1.3e-4 between the two bf16 runs after three steps
_results: dict[int, list[dict]] = {}


def _runs_here(name: str, world_size: int) -> bool:
    if not SPECS[name].runs_at(world_size) or (BATCH // world_size) % SPECS[name].micro_batches:
        return False  # accumulation at 4 ranks: 6 rows each, not 4 equal micro-batches
    return world_size < 4 or SPECS[name].hybrid or EXHAUSTIVE


def option_results(world_size: int) -> list[dict]:
    if world_size not in _results:
        names = [n for n in SPECS if _runs_here(n, world_size)]
        args = (names, world_size < 4)
        # 2 and 3 ranks on the worker's pools (tests/rank_pool.py), with launch's deadline; 4 spawn
        _results[world_size] = (on_pool(run_option_cases, world_size, args, timeout_s=JOIN_S / 3)
                                if world_size in POOLED_WORLD_SIZES else
                                launch(run_option_cases, world_size, args=args, timeout_s=240, join_timeout_s=JOIN_S))
    return _results[world_size]


def _sizes(*world_sizes: int):
    # One xdist group per world size; where loadgroup is not honoured, each world size is still
    # one test, so one spawn per worker that runs it.
    return [pytest.param(ws, id=f"ws{ws}", marks=pytest.mark.xdist_group(f"fsdp-options-ws{ws}"))
            for ws in world_sizes]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _check_weights(name: str, world_size: int):
    spec = SPECS[name]
    reference = train_reference()
    for rank, result in enumerate(option_results(world_size)):
        ours, theirs = result[name]["ours"]["history"], result[name]["torch"]["history"]
        for step, expected in enumerate(reference):
            where = f"{name}, rank {rank}, step {step}"
            if spec.param_dtype is None:
                assert _max_diff(ours[step], theirs[step]) <= FLOAT32_ATOL, where
                assert _max_diff(ours[step], expected) <= FLOAT32_ATOL * (step + 1), where
            else:
                assert _max_diff(ours[step], theirs[step]) <= BF16_ATOL, where
                assert _max_diff(ours[step], expected) <= 2 * _max_diff(theirs[step], expected) + 1e-5, where


def _check_bytes_held(name: str, world_size: int):
    for result in option_results(world_size):
        ours, theirs = result[name]["ours"]["counted"], result[name]["torch"]["counted"]
        assert abs(ours["resident_bytes"] / theirs["resident_bytes"] - 1) <= 0.05, (ours, theirs)
        # The peak counts every live storage, and an asynchronous collective's buffer lives until
        # gloo's worker thread drops it, a moment after wait() returned: one buffer more or less
        # at the peak, by timing (accumulate at 2 ranks read 71000 against 66392 bytes, 6.9%, in
        # one fresh clone's make test of three). 10% holds that and still fails a second copy
        # of the weights or of their gradients.
        assert ours["peak_bytes"] <= 1.10 * theirs["peak_bytes"], (ours, theirs)


def _counted(world_size: int, name: str, side: str) -> dict:
    return option_results(world_size)[0][name][side]["counted"]


def _check_collectives(name: str, world_size: int):
    spec = SPECS[name]
    ours, theirs = _counted(world_size, name, "ours"), _counted(world_size, name, "torch")
    base_ours, base_theirs = _counted(world_size, "defaults", "ours"), _counted(world_size, "defaults", "torch")
    # Every option: one reduce-scatter per unit (ours) or per group (torch's) per step,
    # however many micro-batches it took.
    assert ours["calls"]["reduce_scatter"] == N_UNITS
    assert theirs["calls"]["reduce_scatter"] == N_TORCH_GROUPS
    forward_gathers = N_UNITS * spec.micro_batches
    if not spec.reshard_after_forward:
        assert ours["calls"]["all_gather"] == forward_gathers  # none again in backward
        assert theirs["calls"]["all_gather"] < base_theirs["calls"]["all_gather"]
    else:
        # Backward gathers again every unit but the embedding's (its gradient needs no weight);
        # under checkpointing that gather serves the recomputation.
        assert ours["calls"]["all_gather"] == forward_gathers + (N_UNITS - 1) * spec.micro_batches
        assert theirs["calls"]["all_gather"] == base_theirs["calls"]["all_gather"] * spec.micro_batches
    reduce_bytes = {None: 4, torch.float32: 4, torch.bfloat16: 2}[spec.reduce_dtype]
    gather_bytes = {None: 4, torch.bfloat16: 2}[spec.param_dtype]
    for mine, base in ((ours, base_ours), (theirs, base_theirs)):
        assert mine["payload_bytes"]["reduce_scatter"] == base["payload_bytes"]["reduce_scatter"] * reduce_bytes / 4
        if not spec.reshard_after_forward:
            continue  # other gathers than the defaults' (forward's only): no per-gather average
        per_gather = mine["payload_bytes"]["all_gather"] / mine["calls"]["all_gather"]
        assert per_gather == pytest.approx(
            base["payload_bytes"]["all_gather"] / base["calls"]["all_gather"] * gather_bytes / 4
        )


def _check_accounting(name: str, world_size: int):
    """bench/fsdp/options_run.predict works from the shard layouts alone; the counting mode's
    bytes by collective kind and bytes held between steps must equal it exactly."""
    result = option_results(world_size)[0][name]
    payload, resident = result["predicted"]
    counted = result["ours"]["counted"]
    assert {k: v for k, v in payload.items() if v} == counted["payload_bytes"]
    assert resident == counted["resident_bytes"]


def _check_hybrid(world_size: int):
    ours, theirs = _counted(world_size, "hybrid", "ours"), _counted(world_size, "hybrid", "torch")
    assert ours["calls"]["reduce_scatter"] == N_UNITS
    assert ours["calls"]["all_reduce"] == N_UNITS + 1  # each unit's shard gradients, the replicated ones
    # Each rank all-reduces its shard gradients over its replica group: half the weights'
    # bytes (shard size 2), as torch's does (torch also shards the norms' gains ours replicate).
    assert ours["payload_bytes"]["all_reduce"] == pytest.approx(theirs["payload_bytes"]["all_reduce"], rel=0.05)
    assert ours["payload_bytes"]["reduce_scatter"] == pytest.approx(theirs["payload_bytes"]["reduce_scatter"], rel=0.05)


def _check_checkpointing(world_size: int):
    result = option_results(world_size)[0]
    for step, params in enumerate(result["checkpointing"]["ours"]["history"]):
        for n, value in params.items():
            assert torch.equal(value, result["defaults"]["ours"]["history"][step][n]), (step, n)
    for side in ("ours", "torch"):
        checked = result["checkpointing"][side]["counted"]["peak_parts"]["activations"]
        unchecked = result["defaults"][side]["counted"]["peak_parts"]["activations"]
        assert checked < 0.75 * unchecked, (side, checked, unchecked)  # measured: about 0.5


def _own_slices(world_size: int) -> dict[str, torch.Tensor]:
    """Each sharded weight as ranks that start different and never broadcast hold it: rank r's
    slice of the flattened weight (ours' layout) taken from rank r's own initial model."""
    models = [dict(build_model(seed=1 + r).named_parameters()) for r in range(world_size)]
    expected = {}
    for name, value in models[0].items():
        if name.endswith("gain"):
            continue
        size = -(-value.numel() // world_size)
        flat = torch.cat([models[r][name].detach().reshape(-1)[r * size : (r + 1) * size] for r in range(world_size)])
        expected[name] = flat.view_as(value)
    return expected


def _check_sync_module_states(world_size: int):
    per_rank = [r["sync"] for r in option_results(world_size)]
    rank0 = per_rank[0]["rank0"]
    own = _own_slices(world_size)
    for rank, sync in enumerate(per_rank):
        # True (the default): every rank holds rank 0's values, as torch's FSDP after a broadcast.
        assert _max_diff(sync["ours-True"], rank0) == 0.0, rank
        assert _max_diff(sync["ours-True"], sync["torch-synced"]) == 0.0, rank
        # False: no broadcast; rank r's shard is its own slice of its own weight. Torch's FSDP2
        # (which never broadcasts) slices rows instead of the flattened weight: the same
        # shards where the rows divide evenly (every weight at world size 2).
        sharded = {n: v for n, v in sync["ours-False"].items() if not n.endswith("gain")}
        assert _max_diff(sharded, own) == 0.0, rank
        assert _max_diff(sharded, {n: rank0[n] for n in sharded}) > 0.0, rank
        if world_size == 2:
            assert _max_diff(sharded, {n: sync["torch"][n] for n in sharded}) == 0.0, rank
    # The unsharded gains are rank 0's everywhere (issue 41: one model after wrapping, as under
    # FSDP2 where every parameter is sharded), although every rank started from its own.
    for rank, sync in enumerate(per_rank):
        gains = sync["replicated-False"]
        assert _max_diff(gains, {n: rank0[n] for n in gains}) == 0.0, rank


def _with_context(what: str, check, *args) -> None:
    try:
        check(*args)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from e


@pytest.mark.parametrize("world_size", _sizes(2, 3, 4))
def test_every_option_against_torch_fully_shard(world_size: int):
    """One spawned run per world size, every check of the module docstring on every option that
    runs there (world size 4: hybrid sharding, and every option with FSDP_OPTIONS_EXHAUSTIVE=1)."""
    names = [n for n in SPECS if _runs_here(n, world_size)]
    assert names
    for name in names:
        where = f"{name} at world size {world_size}"
        _with_context(where, _check_weights, name, world_size)
        _with_context(where, _check_bytes_held, name, world_size)
        _with_context(where, _check_accounting, name, world_size)
        if not SPECS[name].hybrid:
            _with_context(where, _check_collectives, name, world_size)
    if world_size == 4:
        _with_context("hybrid", _check_hybrid, world_size)
    else:
        _with_context("checkpointing", _check_checkpointing, world_size)
        _with_context("sync_module_states", _check_sync_module_states, world_size)


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"reshard_after_forward": "yes"}, TypeError, ["reshard_after_forward", "'yes'"]),
        ({"reduce_dtype": torch.int8}, ValueError, ["reduce_dtype", "torch.int8"]),
        ({"shard_group": object()}, ValueError, ["shard_group", "replicate_group"]),
        ({"device_mesh": object()}, ValueError, ["2-D DeviceMesh", "'replicate', 'shard'"]),
        ({"exact_gradients": True, "reshard_after_forward": False}, ValueError, ["exact_gradients", "reshard"]),
    ],
    ids=["bool", "reduce-dtype", "one-group", "mesh", "exact"],
)
def test_bad_options_are_refused_before_any_collective(kwargs, error, words):
    from cs336_basics.model import Linear

    assert not torch.distributed.is_initialized()
    with pytest.raises(error) as info:
        FullyShardedDataParallel(Linear(4, 4), **kwargs)
    for word in words:
        assert word in str(info.value)
