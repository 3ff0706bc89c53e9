"""Rank code for tests/test_fsdp_any_module.py: our FSDP beside torch's ``fully_shard`` on the
models of cs336_systems/bench/fsdp/modules.py (``nn.TransformerEncoder`` at the root alone and per
layer, blocks around ``nn.MultiheadAttention``, tied weights, frozen layers, bf16 compute from
float inputs), at its small test shape.

Every case builds the same model on every rank (seeded), shards it in place with ours and with
torch's ``fully_shard`` (two cases also behind our wrapper with ``shard="all"``), trains each two AdamW
steps on fresh data, each rank on its rows of the global batch, and reports the full weights
(gathered), the bytes each rank holds at rest (parameter shards and their gradients), and which
of our weights were still gathered after a forward.
"""

from __future__ import annotations

import torch
from torch import nn

from cs336_systems.bench.fsdp.modules import (
    CASES, EPS, OURS, TEST_SHAPE, TORCH, Encoder, ModuleCase, full_params, loss_of, shard, trained,
)
from cs336_systems.bench.fsdp.modules import batch as global_batch
from cs336_systems.bench.fsdp.modules import build as build_model
from cs336_systems.launch import RankContext

BATCH, SEQ, STEPS, LR = 6, 5, 2, 1e-2


def build(case: ModuleCase) -> nn.Module:
    return build_model(case, TEST_SHAPE)


def batch(case: ModuleCase, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return global_batch(case, TEST_SHAPE, BATCH, SEQ, seed=100 + step)


def _shard(case: ModuleCase, side: str, model: nn.Module) -> nn.Module:
    if side in (OURS, TORCH):
        return shard(case, side, model)
    from cs336_systems.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, case.compute_dtype, shard="all",
                                    activation_checkpointing=side == "wrapper-checkpointed")


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _resident_bytes(model: nn.Module) -> int:
    """Parameter shards and their gradients this rank holds between steps."""
    total = 0
    for p in model.parameters():
        total += _local(p).numel() * p.element_size()
        if p.grad is not None:
            total += _local(p.grad).numel() * p.grad.element_size()
    return total


def _gathered_after_forward(model: nn.Module) -> list[str]:
    """Names of our block weights still gathered after a forward (the root's stay, as torch's)."""
    weights = [w for block in model.blocks() for unit in block._fsdp_units for w in unit.members]
    return [w.name for w in weights if w.is_gathered]


def run_side(ctx: RankContext, case: ModuleCase, side: str) -> dict:
    model = _shard(case, side, build(case))
    optimizer = torch.optim.AdamW(trained(model), lr=LR, eps=EPS)
    rows = slice(ctx.rank * BATCH // ctx.world_size, (ctx.rank + 1) * BATCH // ctx.world_size)
    gathered: list[str] = []
    for step in range(STEPS):
        x, y = batch(case, step)
        out = model(x[rows])
        if side == OURS and case.per_block:
            gathered += _gathered_after_forward(model)
        loss_of(out, y[rows]).backward()  # no call after it: gradients are reduced as it ends
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return {"full": full_params(side, model), "bytes": _resident_bytes(model), "gathered": gathered,
            "output_dtype": out.dtype}


def train_single(case: ModuleCase, world_size: int) -> dict[str, torch.Tensor]:
    """The reference: one process, the whole batch (its mean loss is the ranks' average)."""
    model = build(case)
    optimizer = torch.optim.AdamW(trained(model), lr=LR, eps=EPS)
    for step in range(STEPS):
        x, y = batch(case, step)
        losses = []
        for r in range(world_size):  # each rank's rows' mean, averaged: equal rows per rank
            rows = slice(r * BATCH // world_size, (r + 1) * BATCH // world_size)
            losses.append(loss_of(model(x[rows]), y[rows]))
        (sum(losses) / world_size).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _mlp(seed: int, norm: type[nn.Module] | None = None) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 16)]
    if norm is not None:
        layers.append(norm(16))
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(16, 4))


def _train_mlp(ctx: RankContext, model: nn.Module, steps: int = 2) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(7 + step)
        x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        rows = slice(ctx.rank * BATCH // ctx.world_size, (ctx.rank + 1) * BATCH // ctx.world_size)
        nn.functional.cross_entropy(model(x[rows]).float(), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()


def state_dict_conventions(ctx: RankContext) -> dict:
    """Item 5: the wrapper's and fully_shard's state dicts under the model's own keys."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from cs336_systems.fsdp import FullyShardedDataParallel, fully_shard

    full = StateDictOptions(full_state_dict=True)
    out = {"keys": list(Encoder(TEST_SHAPE).state_dict())}
    for shard in ("weights", "all"):
        model = _mlp(0) if shard == "weights" else build(CASES[0])
        fsdp = FullyShardedDataParallel(model, shard=shard)
        _train_mlp(ctx, fsdp) if shard == "weights" else None
        plain = _mlp(1) if shard == "weights" else Encoder(TEST_SHAPE)
        plain.load_state_dict(fsdp.state_dict())  # strict: every key, no prefix
        gathered = fsdp.gather_full_params()
        out[shard] = {
            "loaded_equals_gathered": all(torch.equal(p, gathered[n]) for n, p in plain.named_parameters()),
            "dsd_keys": sorted(get_model_state_dict(fsdp, options=full)),
            "plain_keys": sorted(plain.state_dict()),
            "named_parameters": sorted(n for n, _ in fsdp.named_parameters()),
        }
        other = _mlp(2) if shard == "weights" else Encoder(TEST_SHAPE)
        fsdp.load_state_dict(other.state_dict())  # whole tensors in: each rank keeps its slice
        gathered = fsdp.gather_full_params()
        out[shard]["load_round_trip"] = all(torch.equal(p, gathered[n]) for n, p in other.named_parameters())
    inplace = build(CASES[0])
    for block in inplace.blocks():
        fully_shard(block)
    fully_shard(inplace)
    out["fully_shard_dsd_keys"] = sorted(get_model_state_dict(inplace, options=full))
    return out


def one_model_without_sync(ctx: RankContext) -> dict:
    """Item 4: sync_module_states=False from a different init on every rank still makes one
    model (replicated parameters taken from rank 0), before and after training."""
    from cs336_systems.fsdp import FullyShardedDataParallel

    own = _mlp(ctx.rank)
    replicated = {n: p.detach().clone() for n, p in own.named_parameters() if n.endswith("bias") or n.startswith("1.")}
    fsdp = FullyShardedDataParallel(own, sync_module_states=False)
    wrapped = fsdp.gather_full_params()
    _train_mlp(ctx, fsdp)
    return {"wrapped": wrapped, "trained": fsdp.gather_full_params(), "own_replicated": replicated}


def mixed_precision_inputs(ctx: RankContext) -> dict:
    """Item 2: float inputs cast to the compute dtype, or left as given when asked."""
    from cs336_systems.fsdp import FullyShardedDataParallel

    x = torch.randn(2, 8)
    seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    out = {"dtype": FullyShardedDataParallel(seq, torch.bfloat16)(x).dtype}
    off = FullyShardedDataParallel(nn.Sequential(nn.Linear(8, 4)), torch.bfloat16, cast_forward_inputs=False)
    try:
        off(x)
    except RuntimeError as e:
        out["uncast"] = str(e)
    return out


def exact_on_norms(ctx: RankContext) -> dict:
    """Item 3: exact-gradient mode on affine LayerNorm and BatchNorm, beside the default mode."""
    from cs336_systems.fsdp import FullyShardedDataParallel

    result = {}
    for exact in (False, True):
        fsdp = FullyShardedDataParallel(_mlp(0, nn.BatchNorm1d), exact_gradients=exact)
        _train_mlp(ctx, fsdp)
        result[exact] = fsdp.gather_full_params()
    return result


def refusals(ctx: RankContext) -> dict:
    from cs336_systems.fsdp import FullyShardedDataParallel

    errors = {}
    try:
        FullyShardedDataParallel(Encoder(TEST_SHAPE))
    except ValueError as e:
        errors["attention"] = str(e)
    nested = Encoder(TEST_SHAPE)
    nested.encoder.layers[0] = FullyShardedDataParallel(nested.encoder.layers[0], shard="all")
    try:
        FullyShardedDataParallel(nested, shard="all")
    except ValueError as e:
        errors["nested"] = str(e)
    return errors


def compiled(ctx: RankContext) -> dict:
    """Item 6: torch.compile of a fully_shard'ed model (dynamo compiles the blocks' computation;
    our hooks run eagerly, marked torch.compiler.disable), beside the same model in eager."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from cs336_systems.fsdp import fully_shard

    torch._dynamo.reset()
    counters.clear()
    weights = {}
    for compile_it in (False, True):
        model = build(CASES[0])
        for block in model.blocks():
            fully_shard(block)
        fully_shard(model)
        runner = torch.compile(model, backend="aot_eager") if compile_it else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
        rows = slice(ctx.rank * BATCH // ctx.world_size, (ctx.rank + 1) * BATCH // ctx.world_size)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for step in range(STEPS):
                x, y = batch(CASES[0], step)
                loss_of(runner(x[rows]), y[rows]).backward()
                optimizer.step()
                optimizer.zero_grad()
        weights[compile_it] = model.gather_full_params()
    # The wrapper, the handout's sharding (hooks on every Linear), compiled as torch.compile(fsdp).
    from cs336_systems.fsdp import FullyShardedDataParallel

    wrapped = {}
    for compile_it in (False, True):
        fsdp = FullyShardedDataParallel(_mlp(0))
        optimizer = torch.optim.SGD(fsdp.parameters(), lr=0.1)
        runner = torch.compile(fsdp, backend="aot_eager") if compile_it else fsdp
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for step in range(STEPS):
                g = torch.Generator().manual_seed(7 + step)
                x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
                rows = slice(ctx.rank * BATCH // ctx.world_size, (ctx.rank + 1) * BATCH // ctx.world_size)
                nn.functional.cross_entropy(runner(x[rows]), y[rows]).backward()
                optimizer.step()
                optimizer.zero_grad()
        wrapped[compile_it] = fsdp.gather_full_params()
    return {"weights": weights, "wrapped": wrapped, "graphs": counters["stats"]["unique_graphs"]}


def sides(case: ModuleCase) -> tuple[str, ...]:
    """Ours in place and torch's for every case; the wrapper (the same units, built for the
    user) on the first only, and with activation checkpointing on the second, to keep the job
    short."""
    extra = {"nested": ("wrapper",), "tied": ("wrapper-checkpointed",)}.get(case.name, ())
    return ("ours", *extra, "torch")


def run_module_cases(ctx: RankContext) -> dict:
    results: dict = {case.name: {side: run_side(ctx, case, side) for side in sides(case)} for case in CASES}
    for probe in (one_model_without_sync, exact_on_norms):
        results[probe.__name__] = probe(ctx)
    if ctx.world_size == 2:  # checks no rank count changes; dynamo's tracing is slow: once is enough
        for probe in (state_dict_conventions, mixed_precision_inputs, refusals, compiled):
            results[probe.__name__] = probe(ctx)
    return results
