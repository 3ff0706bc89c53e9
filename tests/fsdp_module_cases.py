"""Rank code for tests/test_fsdp_any_module.py: our FSDP beside torch's ``fully_shard`` on torch's
own modules (``nn.TransformerEncoder``, whose ``nn.MultiheadAttention`` reads ``in_proj_weight``
and ``out_proj.weight`` without calling a Linear), nested per block then the root.

Every case builds the same model on every rank (seeded), shards it three ways (ours in place,
ours behind the wrapper with ``shard="all"``, torch's ``fully_shard``), trains each three AdamW
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
BATCH, SEQ, STEPS, LR = 6, 5, 3, 1e-2
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

    return FullyShardedDataParallel(model, case.compute_dtype, shard="all")


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


def run_module_cases(ctx: RankContext) -> dict:
    return {case.name: {side: run_side(ctx, case, side) for side in ("ours", "wrapper", "torch")}
            for case in CASES}
