"""The sharded optimizer (ZeRO stage 1) trains exactly like the optimizer it shards.

Every case of one world size runs in one run on the worker's pool of ranks (spawning costs seconds, a
case milliseconds) and returns what the parent asserts. Each rank trains the sharded model and
an unsharded reference (a deep copy under a plain ``torch.optim`` optimizer) on the same
full batch, so the reference is computed in the same process from the same gradients.

Tolerance: none. The owner of a parameter runs the very update the unsharded optimizer runs, on
bitwise-identical gradients (all ranks compute the same full-batch backward), and a broadcast
copies bits, so parameters must be equal, not close. The public CS336 test compares with
numpy's default rtol of 1e-7, which leaves no room for a different update either.
"""

from __future__ import annotations

import copy
import io
import random
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_systems.launch import RankContext
from cs336_systems.units import MB
from cs336_systems.zero import ShardedOptimizer, assign_to_ranks
from tests.rank_pool import on_pool
from tests.ddp_cases import IN_FEATURES, OUT_FEATURES, EdgeCaseModel

pytestmark = pytest.mark.problem("optimizer_state_sharding")

WORLD_SIZES = (2, 3)
STEPS = 4
# 1e-3 MiB = 1048 bytes: a few small parameters per bucket, hidden64.weight (2 KiB) alone.
TINY_BUCKET_MB = 1e-3
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)),
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
}


# Training helpers (run inside the ranks) ----------------------------------------------------


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same full batch on every rank and for the reference."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(12, IN_FEATURES, generator=g), torch.randn(12, OUT_FEATURES, generator=g)


def _two_groups(model: EdgeCaseModel) -> list[dict[str, Any]]:
    """Two groups with their own lr and weight decay; the second holds the frozen and unused
    parameters. EdgeCaseModel has 11 parameters, divisible by neither 2 nor 3."""
    first = [model.encode.weight, model.hidden.weight, model.hidden.bias, model.hidden64.weight]
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return [{"params": first}, {"params": rest, "lr": 0.02, "weight_decay": 0.0}]


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    optimizer.zero_grad()
    x, y = _batch(step)
    F.mse_loss(model(x), y).backward()
    optimizer.step()


def _same(a: nn.Module, b: nn.Module) -> list[str]:
    """Names of the parameters and buffers that differ (bitwise) between ``a`` and ``b``."""
    sb = b.state_dict()
    return [name for name, t in a.state_dict().items() if not torch.equal(t, sb[name])]


def _fresh_pair(seed: int = 0) -> tuple[EdgeCaseModel, EdgeCaseModel]:
    torch.manual_seed(seed)
    model = EdgeCaseModel()
    return model, copy.deepcopy(model)


def _serialized(obj: Any) -> Any:
    """``obj`` after a torch.save / torch.load round trip, as a checkpoint file would give it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _tensors_differ(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return not (both and torch.equal(a, b))
    if isinstance(a, dict):
        return a.keys() != b.keys() or any(_tensors_differ(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) != len(b) or any(_tensors_differ(x, y) for x, y in zip(a, b))
    return a != b


class _BroadcastRecorder:
    """Replaces ``dist.broadcast`` for a while, recording each call's payload in bytes and the
    address of the storage it sends from or receives into."""

    def __init__(self):
        self.payload_bytes: list[int] = []
        self.data_ptrs: list[int] = []
        self._original: Callable | None = None

    def __enter__(self) -> _BroadcastRecorder:
        self._original = dist.broadcast

        def recording_broadcast(tensor, *args, **kwargs):
            self.payload_bytes.append(tensor.numel() * tensor.element_size())
            self.data_ptrs.append(tensor.data_ptr())
            return self._original(tensor, *args, **kwargs)

        dist.broadcast = recording_broadcast
        return self

    def __exit__(self, *exc) -> None:
        dist.broadcast = self._original


# Cases (each returns what the parent asserts) ----------------------------------------------


def _case_matches_unsharded(name: str, bucket_size_mb: float) -> dict[str, Any]:
    cls, kwargs = OPTIMIZERS[name]
    sharded, reference = _fresh_pair()
    optimizer = ShardedOptimizer(_two_groups(sharded), cls, bucket_size_mb=bucket_size_mb, **kwargs)
    reference_optimizer = cls(_two_groups(reference), **kwargs)
    differing = []
    for step in range(STEPS):
        _train_step(sharded, optimizer, step)
        _train_step(reference, reference_optimizer, step)
        differing.append(_same(sharded, reference))
    moved = not torch.equal(sharded.encode.weight, _fresh_pair()[0].encode.weight)
    owned = len(optimizer.owned_indices(dist.get_rank()))
    return {"differing": differing, "moved": moved, "owned": owned}


def _case_lr_scheduler() -> dict[str, Any]:
    """A scheduler edits the wrapper's param groups; the shards must follow."""
    cls, kwargs = OPTIMIZERS["adamw"]
    sharded, reference = _fresh_pair()
    optimizer = ShardedOptimizer(_two_groups(sharded), cls, **kwargs)
    reference_optimizer = cls(_two_groups(reference), **kwargs)
    schedulers = [
        torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
        for o in (optimizer, reference_optimizer)
    ]
    differing = []
    for step in range(STEPS):
        _train_step(sharded, optimizer, step)
        _train_step(reference, reference_optimizer, step)
        for scheduler in schedulers:
            scheduler.step()
        differing.append(_same(sharded, reference))
    return {"differing": differing}


def _case_add_param_group() -> dict[str, Any]:
    """Start without head and never_used; add them as a new group after two steps."""
    cls, kwargs = OPTIMIZERS["adamw"]
    sharded, reference = _fresh_pair()

    def initial(model: EdgeCaseModel) -> list[nn.Parameter]:
        late = {id(p) for p in (*model.head.parameters(), *model.never_used.parameters())}
        return [p for p in model.parameters() if id(p) not in late]

    def late_group(model: EdgeCaseModel) -> dict[str, Any]:
        return {"params": [*model.head.parameters(), *model.never_used.parameters()], "lr": 0.05}

    optimizer = ShardedOptimizer(initial(sharded), cls, bucket_size_mb=TINY_BUCKET_MB, **kwargs)
    reference_optimizer = cls(initial(reference), **kwargs)
    differing = []
    for step in range(2 * STEPS):
        if step == STEPS:
            optimizer.add_param_group(late_group(sharded))
            reference_optimizer.add_param_group(late_group(reference))
        _train_step(sharded, optimizer, step)
        _train_step(reference, reference_optimizer, step)
        differing.append(_same(sharded, reference))
    sizes = [p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"]]
    return {
        "differing": differing,
        "loads": list(optimizer.loads),
        "largest": max(sizes),
        "owners": list(optimizer.owners),
        "local_groups": len(optimizer.local_optimizer.param_groups),
    }


def _case_one_parameter() -> dict[str, Any]:
    """One parameter: every rank but its owner owns nothing at all."""
    cls, kwargs = OPTIMIZERS["adamw"]
    sharded, reference = _fresh_pair()
    optimizer = ShardedOptimizer([sharded.encode.weight], cls, **kwargs)
    reference_optimizer = cls([reference.encode.weight], **kwargs)
    for step in range(STEPS):
        _train_step(sharded, optimizer, step)
        _train_step(reference, reference_optimizer, step)
    return {"differing": _same(sharded, reference), "owners": list(optimizer.owners)}


def _case_bucketing() -> dict[str, Any]:
    """Count and size the broadcasts of one step, with the default cap and a small one."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(12)])  # 24 params, 4 KiB weights
    x = torch.randn(8, 32)
    out: dict[str, Any] = {"num_params": len(list(model.parameters()))}
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    for label, bucket_size_mb in (("default", 32.0), ("capped", 12288 / MB)):
        optimizer = ShardedOptimizer(
            model.parameters(), torch.optim.SGD, bucket_size_mb=bucket_size_mb, lr=0.01
        )
        optimizer.zero_grad()
        model(x).square().mean().backward()
        with _BroadcastRecorder() as recorder:
            optimizer.step()
        out[label] = {
            "payload_bytes": recorder.payload_bytes,
            "reported_calls": optimizer.broadcast_calls_last_step,
            "owners": list(optimizer.owners),
        }
    return out


def _case_large_parameter_in_place() -> dict[str, Any]:
    """A 1 MiB weight among small parameters: it travels from its own storage (no copy, no
    buffer), the small ones packed; the step still equals the unsharded one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 4))  # weights 1 MiB and 8 KiB
    reference = copy.deepcopy(model)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.01)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    x = torch.randn(8, 512)
    for m, o in ((model, optimizer), (reference, reference_optimizer)):
        o.zero_grad()
        m(x).square().mean().backward()
    reference_optimizer.step()
    large = model[0].weight
    with _BroadcastRecorder() as recorder:
        optimizer.step()
    return {
        "differing": _same(model, reference),
        "calls": len(recorder.payload_bytes),
        "large_in_place": recorder.data_ptrs.count(large.data_ptr()),
        "large_owner": optimizer.owners[0],
        "small_owners": sorted(set(optimizer.owners[1:])),
        "payload_bytes": sum(recorder.payload_bytes),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def _case_state_dict_round_trip() -> dict[str, Any]:
    """Checkpoint after two steps, resume four ways, and compare with uninterrupted training."""
    cls, kwargs = OPTIMIZERS["adamw"]
    sharded, reference = _fresh_pair()
    optimizer = ShardedOptimizer(_two_groups(sharded), cls, bucket_size_mb=TINY_BUCKET_MB, **kwargs)
    reference_optimizer = cls(_two_groups(reference), **kwargs)
    for step in range(2):
        _train_step(sharded, optimizer, step)
        _train_step(reference, reference_optimizer, step)
    optimizer.param_groups[1]["lr"] = 0.03  # a hyperparameter edit must be saved too
    reference_optimizer.param_groups[1]["lr"] = 0.03
    model_checkpoint = _serialized(sharded.state_dict())
    shard_checkpoint = _serialized(optimizer.state_dict())
    consolidated = _serialized(optimizer.consolidated_state_dict())
    reference_checkpoint = _serialized(reference_optimizer.state_dict())
    consolidated_differs = _tensors_differ(consolidated, reference_checkpoint)

    for step in range(2, STEPS + 2):
        _train_step(sharded, optimizer, step)

    def resume(make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]) -> list[str]:
        model = EdgeCaseModel()
        model.load_state_dict(model_checkpoint)
        resumed = make_optimizer(model)
        for step in range(2, STEPS + 2):
            _train_step(model, resumed, step)
        return _same(model, sharded)

    def sharded_from_shard(model: nn.Module) -> torch.optim.Optimizer:
        o = ShardedOptimizer(_two_groups(model), cls, bucket_size_mb=TINY_BUCKET_MB, **kwargs)
        o.load_state_dict(copy.deepcopy(shard_checkpoint))
        return o

    def plain_from_consolidated(model: nn.Module) -> torch.optim.Optimizer:
        o = cls(_two_groups(model), **kwargs)
        o.load_state_dict(copy.deepcopy(consolidated))
        return o

    def sharded_from_plain(model: nn.Module) -> torch.optim.Optimizer:
        o = ShardedOptimizer(_two_groups(model), cls, **kwargs)
        o.load_consolidated_state_dict(copy.deepcopy(reference_checkpoint))
        return o

    return {
        "consolidated_differs": consolidated_differs,
        "shard_keys": sorted(shard_checkpoint),
        "from_shard": resume(sharded_from_shard),
        "plain_from_consolidated": resume(plain_from_consolidated),
        "sharded_from_plain": resume(sharded_from_plain),
    }


def _case_misuse() -> dict[str, str]:
    """Each bad load on every rank alike; returns the message each one raised."""
    cls, kwargs = OPTIMIZERS["adamw"]
    model, _ = _fresh_pair()
    optimizer = ShardedOptimizer(_two_groups(model), cls, **kwargs)
    good = optimizer.state_dict()
    other_rank = (good["rank"] + 1) % dist.get_world_size()
    other_world_size = good["world_size"] + 1
    unsharded = cls(model.parameters(), **kwargs).state_dict()  # one group of 11
    bad_loads = {
        "world_size": lambda: optimizer.load_state_dict({**good, "world_size": other_world_size}),
        "rank": lambda: optimizer.load_state_dict({**good, "rank": other_rank}),
        "owners": lambda: optimizer.load_state_dict({**good, "owners": good["owners"][::-1] + [0]}),
        "torch_format": lambda: optimizer.load_state_dict(unsharded),
        "consolidated_groups": lambda: optimizer.load_consolidated_state_dict(unsharded),
    }
    errors = {}
    for name, load in bad_loads.items():
        try:
            load()
            errors[name] = "no error"
        except ValueError as e:
            errors[name] = str(e)
    return errors


def _all_cases(ctx: RankContext) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in OPTIMIZERS:
        for label, bucket_size_mb in (("default", 32.0), ("tiny", TINY_BUCKET_MB)):
            results[f"matches-{name}-{label}"] = _case_matches_unsharded(name, bucket_size_mb)
    results["lr_scheduler"] = _case_lr_scheduler()
    results["add_param_group"] = _case_add_param_group()
    results["one_parameter"] = _case_one_parameter()
    results["bucketing"] = _case_bucketing()
    results["large_in_place"] = _case_large_parameter_in_place()
    results["state_dict"] = _case_state_dict_round_trip()
    results["misuse"] = _case_misuse()
    return results


_results: dict[int, list[dict[str, Any]]] = {}


def sharded_results(world_size: int) -> list[dict[str, Any]]:
    """Every rank's results for one world size, computed once per test process."""
    if world_size not in _results:
        _results[world_size] = on_pool(_all_cases, world_size, timeout_s=120)
    return _results[world_size]


# Tests with process groups -----------------------------------------------------------------

MATCH_CASES = [f"matches-{name}-{label}" for name in OPTIMIZERS for label in ("default", "tiny")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", MATCH_CASES)
def test_matches_unsharded_optimizer(world_size, case):
    """Two param groups, tied weights, frozen and unused parameters, float64 next to float32."""
    per_rank = sharded_results(world_size)
    for rank, results in enumerate(per_rank):
        result = results[case]
        assert all(not d for d in result["differing"]), f"rank {rank}: {result['differing']}"
        assert result["moved"], "training did not change the parameters: the test proves nothing"
    assert sum(r[case]["owned"] for r in per_rank) == 11  # every parameter owned exactly once


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_lr_scheduler_reaches_the_shards(world_size):
    for rank, results in enumerate(sharded_results(world_size)):
        assert all(not d for d in results["lr_scheduler"]["differing"]), f"rank {rank}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_add_param_group_during_training(world_size):
    per_rank = sharded_results(world_size)
    for rank, results in enumerate(per_rank):
        result = results["add_param_group"]
        assert all(not d for d in result["differing"]), f"rank {rank}: {result['differing']}"
        assert result["local_groups"] == 2  # one local group per group, even when empty
    result = per_rank[0]["add_param_group"]
    assert all(r["add_param_group"]["owners"] == result["owners"] for r in per_rank)
    assert max(result["loads"]) - min(result["loads"]) <= result["largest"]
    assert len(result["owners"]) == 11


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ranks_owning_nothing_still_follow(world_size):
    for rank, results in enumerate(sharded_results(world_size)):
        assert results["one_parameter"]["owners"] == [0]
        assert not results["one_parameter"]["differing"], f"rank {rank}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcasts_are_bucketed(world_size):
    results = sharded_results(world_size)[0]["bucketing"]
    # Each parameter travels once, from its owner, whatever the cap.
    for label in ("default", "capped"):
        step = results[label]
        assert sum(step["payload_bytes"]) == results["param_bytes"]
        assert step["reported_calls"] == len(step["payload_bytes"])
    # 32 MB holds the whole model: one broadcast per rank owning something.
    assert len(results["default"]["payload_bytes"]) == len(set(results["default"]["owners"]))
    # A 12 KiB cap (about two weights): a few parameters per bucket, far fewer calls than
    # parameters.
    capped = results["capped"]["payload_bytes"]
    assert max(capped) <= 12288
    assert len(set(results["default"]["owners"])) < len(capped) <= results["num_params"] // 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_large_parameters_travel_in_place(world_size):
    for rank, results in enumerate(sharded_results(world_size)):
        result = results["large_in_place"]
        assert not result["differing"], f"rank {rank}: {result['differing']}"
        # One broadcast straight from the weight's storage on every rank (sender and receivers),
        # one packed buffer per rank owning small parameters, each byte sent once.
        assert result["large_in_place"] == 1, f"rank {rank}: the 1 MiB weight was copied"
        assert result["large_owner"] not in result["small_owners"]
        assert result["calls"] == 1 + len(result["small_owners"])
        assert result["payload_bytes"] == result["param_bytes"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_state_dict_round_trips(world_size):
    for rank, results in enumerate(sharded_results(world_size)):
        result = results["state_dict"]
        assert result["shard_keys"] == ["format", "owners", "rank", "shard", "world_size"]
        assert not result["consolidated_differs"], f"rank {rank}: consolidated != torch's"
        for resumed in ("from_shard", "plain_from_consolidated", "sharded_from_plain"):
            assert not result[resumed], f"rank {rank} resumed {resumed}: {result[resumed]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bad_state_dicts_raise(world_size):
    errors = sharded_results(world_size)[0]["misuse"]
    assert f"saved with world size {world_size + 1}" in errors["world_size"]
    assert "each rank must load its own shard" in errors["rank"]
    assert "assigns 12 parameters" in errors["owners"]
    assert "load_consolidated_state_dict" in errors["torch_format"]
    assert "param groups of sizes [11]" in errors["consolidated_groups"]


# Tests without process groups --------------------------------------------------------------


def test_optimizer_cls_must_be_an_optimizer():
    for bad in ("adamw", nn.Linear, print):
        with pytest.raises(TypeError, match="subclass of torch.optim.Optimizer"):
            ShardedOptimizer(nn.Linear(2, 2).parameters(), bad, lr=0.1)


def test_without_process_group_says_what_to_do():
    with pytest.raises(RuntimeError, match="process group is not initialised"):
        ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.AdamW, lr=0.1)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "32", True])
def test_bad_bucket_size_raises_before_any_collective(bad):
    with pytest.raises(ValueError, match="bucket_size_mb"):
        ShardedOptimizer(
            nn.Linear(2, 2).parameters(), torch.optim.AdamW, bucket_size_mb=bad, lr=0.1
        )


def test_assignment_by_hand():
    # 5 -> rank 0; 3 -> rank 1 (load 0); the other 3 -> rank 1 (3 < 5); 1 -> rank 0 (5 < 6).
    assert assign_to_ranks([5, 3, 3, 1], 2) == [0, 1, 1, 0]
    # Equal sizes: round robin from rank 0, whatever the world size.
    assert assign_to_ranks([4] * 5, 3) == [0, 1, 2, 0, 1]
    # More ranks than items: each item alone, the rest own nothing.
    assert assign_to_ranks([1, 2], 4) == [1, 0]
    assert assign_to_ranks([], 3) == []


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_assignment_is_balanced_complete_and_deterministic(world_size):
    rng = random.Random(world_size)
    for _ in range(50):
        count = rng.randint(1, 30)
        sizes = [rng.choice([0, 1, 7, 64, 4096]) * rng.randint(1, 9) for _ in range(count)]
        owners = assign_to_ranks(sizes, world_size)
        assert owners == assign_to_ranks(list(sizes), world_size)
        assert len(owners) == len(sizes) and all(0 <= r < world_size for r in owners)
        loads = [sum(s for s, r in zip(sizes, owners) if r == rank) for rank in range(world_size)]
        assert max(loads) - min(loads) <= max(sizes)
        # Items added later land on top of the current loads and keep the balance.
        more = [rng.randint(0, 5000) for _ in range(rng.randint(1, 10))]
        later = assign_to_ranks(more, world_size, loads)
        for size, rank in zip(more, later):
            loads[rank] += size
        assert max(loads) - min(loads) <= max(sizes + more)


def test_assignment_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        assign_to_ranks([1], 0)
    with pytest.raises(ValueError, match="initial_loads has 1 entries, but world_size is 2"):
        assign_to_ranks([1], 2, [0])
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        assign_to_ranks([-1], 2)
