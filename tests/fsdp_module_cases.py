"""Rank code for tests/test_fsdp_any_module.py: our FSDP beside torch's ``fully_shard`` on torch's
own modules (``nn.TransformerEncoder``, whose ``nn.MultiheadAttention`` reads ``in_proj_weight``
and ``out_proj.weight`` without calling a Linear), nested per block then the root.

Every case builds the same model on every rank (seeded), shards it three ways (ours in place,
ours behind the wrapper with ``shard="all"``, torch's ``fully_shard``), trains each two AdamW
steps on fresh data, each rank on its rows of the global batch, and reports the full weights
(gathered), the bytes each rank holds at rest (parameter shards and their gradients), and which
of our weights were still gathered after a forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cs336_systems.launch import RankContext

D, HEADS, FF, LAYERS, VOCAB = 16, 2, 24, 2, 23
BATCH, SEQ, STEPS, LR = 6, 5, 2, 1e-2
# AdamW normalises each step: a parameter whose true gradient is zero (the key part of
# in_proj_bias: softmax ignores a shift of every key) moves by lr on rounding noise alone,
# whatever its sign. An eps above that noise (about 1e-9 here) keeps such steps at noise size.
EPS = 1e-4


class Encoder(nn.Module):
    """torch's TransformerEncoder between a float input projection and a head."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def blocks(self) -> list[nn.Module]:
        return list(self.encoder.layers)


class TiedLM(nn.Module):
    """Token embedding tied to the LM head, encoder layers between, a final LayerNorm."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)


@dataclass(frozen=True)
class ModuleCase:
    """One model and setting; ``frozen`` names parameters that do not train."""

    name: str
    model: str  # "encoder" (float inputs) or "tied" (tokens)
    compute_dtype: torch.dtype | None = None
    frozen: tuple[str, ...] = ()


CASES = (
    ModuleCase("encoder", "encoder"),
    ModuleCase("tied", "tied"),
    ModuleCase("frozen", "encoder", frozen=("encoder.layers.0.", "head.bias")),
    ModuleCase("bf16", "encoder", compute_dtype=torch.bfloat16),
)


def build(case: ModuleCase) -> nn.Module:
    torch.manual_seed(0)
    model = Encoder() if case.model == "encoder" else TiedLM()
    for name, p in model.named_parameters():
        if name.startswith(case.frozen):
            p.requires_grad_(False)
    return model


def batch(case: ModuleCase, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if case.model == "encoder":
        return torch.randn(BATCH, SEQ, D, generator=g), torch.randint(0, 3, (BATCH, SEQ), generator=g)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


def _shard(case: ModuleCase, side: str, model: nn.Module) -> nn.Module:
    if side == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=case.compute_dtype, reduce_dtype=torch.float32)
        for block in model.blocks():
            fully_shard(block, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)
    if side == "ours":
        from cs336_systems.fsdp import fully_shard

        for block in model.blocks():
            fully_shard(block, compute_dtype=case.compute_dtype)
        return fully_shard(model, compute_dtype=case.compute_dtype)
    from cs336_systems.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, case.compute_dtype, shard="all",
                                    activation_checkpointing=side == "wrapper-checkpointed")


def _full(side: str, model: nn.Module) -> dict[str, torch.Tensor]:
    if side == "torch":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return model.gather_full_params()


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
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    rows = slice(ctx.rank * BATCH // ctx.world_size, (ctx.rank + 1) * BATCH // ctx.world_size)
    gathered: list[str] = []
    for step in range(STEPS):
        x, y = batch(case, step)
        out = model(x[rows])
        if side == "ours":
            inner = model
            gathered += _gathered_after_forward(inner)
        loss_of(out, y[rows]).backward()  # no call after it: gradients are reduced as it ends
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return {"full": _full(side, model), "bytes": _resident_bytes(model), "gathered": gathered,
            "output_dtype": out.dtype}


def train_single(case: ModuleCase, world_size: int) -> dict[str, torch.Tensor]:
    """The reference: one process, the whole batch (its mean loss is the ranks' average)."""
    model = build(case)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
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
    out = {"keys": list(Encoder().state_dict())}
    for shard in ("weights", "all"):
        model = _mlp(0) if shard == "weights" else build(CASES[0])
        fsdp = FullyShardedDataParallel(model, shard=shard)
        _train_mlp(ctx, fsdp) if shard == "weights" else None
        plain = _mlp(1) if shard == "weights" else Encoder()
        plain.load_state_dict(fsdp.state_dict())  # strict: every key, no prefix
        gathered = fsdp.gather_full_params()
        out[shard] = {
            "loaded_equals_gathered": all(torch.equal(p, gathered[n]) for n, p in plain.named_parameters()),
            "dsd_keys": sorted(get_model_state_dict(fsdp, options=full)),
            "plain_keys": sorted(plain.state_dict()),
            "named_parameters": sorted(n for n, _ in fsdp.named_parameters()),
        }
        other = _mlp(2) if shard == "weights" else Encoder()
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
        FullyShardedDataParallel(Encoder())
    except ValueError as e:
        errors["attention"] = str(e)
    nested = Encoder()
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
    extra = {CASES[0].name: ("wrapper",), CASES[1].name: ("wrapper-checkpointed",)}.get(case.name, ())
    return ("ours", *extra, "torch")


def run_module_cases(ctx: RankContext) -> dict:
    results: dict = {case.name: {side: run_side(ctx, case, side) for side in sides(case)} for case in CASES}
    for probe in (one_model_without_sync, exact_on_norms):
        results[probe.__name__] = probe(ctx)
    if ctx.world_size == 2:  # checks no rank count changes; dynamo's tracing is slow: once is enough
        for probe in (state_dict_conventions, mixed_precision_inputs, refusals, compiled):
            results[probe.__name__] = probe(ctx)
    return results
