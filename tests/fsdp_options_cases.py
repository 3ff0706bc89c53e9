"""Rank functions and references for the FSDP options tests (tests/test_fsdp_options.py).

``run_option_cases`` trains, inside one spawned process group, every option of
``cs336_systems.bench.fsdp.options.SPECS`` that runs at its world size, on our FSDP and on torch's
``fully_shard`` side by side from the same initial weights and data, and returns per option and
side: the full parameters after every step, then one counted step (collective calls and bytes
by kind, bytes held between steps, peak bytes and their split; bench/fsdp/accounting.py). It
also runs the ``sync_module_states`` cases on ranks that start different.
``train_reference`` trains the same model in this process on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_basics.model import Embedding, Linear, RMSNorm
from cs336_systems.bench.fsdp.accounting import StepAccounting
from cs336_systems.bench.fsdp.options import OURS, SPECS, TORCH, build_side, hybrid_mesh
from cs336_systems.bench.fsdp.options_run import predict
from cs336_systems.launch import RankContext

BATCH = 24  # sequences per step: 4 micro-batches of whole rows at world sizes 2 and 3; 4 ranks
SEQ = 4
VOCAB, D_MODEL, D_HIDDEN, DEPTH = 24, 16, 32, 3
STEPS = 3
LR = 0.05


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(D_MODEL)
        self.up = Linear(D_MODEL, D_HIDDEN)
        self.down = Linear(D_HIDDEN, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class BlockLM(nn.Module):
    """An embedding, ``layers`` (what torch's side shards one by one and checkpointing wraps)
    and an LM head: the Transformer's layout at a test's size."""

    def __init__(self):
        super().__init__()
        self.embedding = Embedding(VOCAB, D_MODEL)
        self.layers = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def build_model(seed: int = 0) -> BlockLM:
    torch.manual_seed(seed)
    return BlockLM()


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def train_reference(steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    """Single-process float32 training on the whole batch: the parameters after every step."""
    model = build_model()
    optimizer = sgd(model.parameters())
    history = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        tokens, targets = batch(step)
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history


def _counted_step(side, tokens, targets) -> dict:
    accounting = StepAccounting(side)
    with accounting:
        side.step(tokens, targets)
    return {
        "calls": dict(accounting.calls),
        "payload_bytes": dict(accounting.payload_bytes),
        "resident_bytes": accounting.resident_bytes,
        "peak_bytes": accounting.peak_bytes,
        "peak_parts": dict(accounting.peak_parts),
    }


def _sync_cases(ctx: RankContext) -> dict:
    """Ranks start from different weights; what each wrapper holds right after construction."""
    base = build_model(seed=1 + ctx.rank)
    with torch.no_grad():
        for block in base.layers:  # gains start at one everywhere: make the ranks' differ too
            block.norm.gain.add_(ctx.rank)
    out = {"rank0": {n: p.detach().clone() for n, p in build_model(seed=1).named_parameters()}}
    for flag in (True, False):
        ours = build_side(SPECS["defaults"], OURS, base, sgd, sync_module_states=flag)
        out[f"ours-{flag}"] = ours.full_params()
        out[f"replicated-{flag}"] = {n: p.detach().clone() for n, p in ours.module.named_parameters()
                                     if n.endswith("gain")}
    torch_side = build_side(SPECS["defaults"], TORCH, base, sgd)
    out["torch"] = torch_side.full_params()
    # FSDP1's sync_module_states=True, done by hand before fully_shard: rank 0's values.
    synced = build_model(seed=1 + ctx.rank)
    for p in synced.parameters():
        dist.broadcast(p.data, src=0)
    out["torch-synced"] = build_side(SPECS["defaults"], TORCH, synced, sgd).full_params()
    return out


def run_option_cases(ctx: RankContext, names: list[str], sync_cases: bool = True) -> dict:
    """Rank function: every option of ``names`` that runs at this world size, both sides (and
    the ``sync_module_states`` cases unless ``sync_cases`` is False)."""
    rows = BATCH // ctx.world_size
    mine = slice(ctx.rank * rows, (ctx.rank + 1) * rows)
    mesh = None
    results: dict = {"sync": _sync_cases(ctx) if sync_cases else None}
    base = build_model()
    for name in names:
        spec = SPECS[name]
        if not spec.runs_at(ctx.world_size):
            continue
        if spec.hybrid and mesh is None:
            mesh = hybrid_mesh(ctx.device.type)
        result = {}
        for side_name in (OURS, TORCH):
            side = build_side(spec, side_name, base, sgd, mesh=mesh)
            history = []
            for step in range(STEPS):
                tokens, targets = batch(step)
                side.step(tokens[mine], targets[mine])
                history.append(side.full_params())
            tokens, targets = batch(STEPS)
            result[side_name] = {"history": history, "counted": _counted_step(side, tokens[mine], targets[mine])}
            if side_name == OURS:
                result["predicted"] = predict(side, state_copies=1)  # SGD's momentum
            if side.finish is not None:
                side.model.release()
        results[name] = result
    return results
