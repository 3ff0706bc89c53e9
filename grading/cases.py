"""The rank functions of the hidden-style suite: train through a submission's adapters, check as we go.

Each rank also trains an independent single-process reference (the whole batch, plain torch, no
collective) from rank 0's initial weights, and after every step compares every parameter it
holds with it, so a missing average, a missing sync or a rank left behind fails on the rank where
it happens. Initial weights come from ``os.urandom``: no seed reproduces rank 0's, so a wrapper
that rebuilds weights from a seed instead of broadcasting them fails the construction check.
Failed checks raise AssertionError with the one line the grade shows.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
import torch._dynamo  # noqa: F401 - an optimizer's constructor imports it (2 s): once here, not per forked rank
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from grading import probes
from grading.ranks import Rank
from grading.submission import load_adapter

BATCH = 12  # divisible by world sizes 2 and 3
WIDTH = 16
RTOL, ATOL = 1e-4, 1e-6  # float32: averaging shards vs one mean differs by a few ulps; a sum is 2x off


class Net(nn.Module):
    """An MLP with a probe after its first layer (collectives before the probe's backward overlapped
    backward), a frozen bias, a parameter that never requires grad and, optionally, tied weights
    and a layer no rank ever uses."""

    def __init__(self, tied: bool = False, unused: bool = False, depth: int = 4, width: int = WIDTH):
        super().__init__()
        self.first = nn.Linear(8, width)
        self.probe = probes.BackwardProbe()
        self.hidden = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))
        self.frozen = nn.Linear(width, width)
        self.frozen.bias.requires_grad_(False)
        self.head = nn.Linear(width, 4)
        self.fixed = nn.Parameter(torch.full((2,), 2.0), requires_grad=False)
        self.tied = tied
        if tied:  # one weight used by two layers
            self.hidden[-1].weight = self.hidden[0].weight
        if unused:
            self.never_used = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.probe(torch.tanh(self.first(x)))
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        return self.head(torch.tanh(self.frozen(h)))


class Equal(nn.Module):
    """Layers of one size, no bias: bucket counts follow from the cap alone."""

    def __init__(self, layers: int = 8, width: int = 32):
        super().__init__()
        self.first = nn.Linear(8, width, bias=False)
        self.probe = probes.BackwardProbe()
        self.hidden = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
        self.head = nn.Linear(width, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.probe(self.first(x))
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        return self.head(h)


@dataclass(frozen=True)
class DDPCase:
    get: str  # adapter that wraps the module
    after_backward: str  # adapter called after backward
    train_batch_start: str | None = None  # bucketed only
    bucket_size_mb: float | None = None  # bucketed only
    model: str = "net"  # "net", "tied", "unused" or "equal"
    optimizer: str = "sgd"  # or "adamw"
    steps: int = 3


def build(model: str) -> nn.Module:
    if model == "equal":
        return Equal()
    return Net(tied=model == "tied", unused=model == "unused")


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def batch(step: int, in_features: int = 8, out_features: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, in_features, generator=g), torch.randn(BATCH, out_features, generator=g)


def shared_seed() -> int:
    """A seed from rank 0's entropy, the same on every rank."""
    seed = torch.tensor([int.from_bytes(os.urandom(4), "little")], dtype=torch.int64)
    with _unlogged():
        dist.broadcast(seed, 0)
    return int(seed.item())


class _unlogged:
    """The suite's own collectives are not counted as the submission's."""

    def __enter__(self):
        probes.LOG.paused = True

    def __exit__(self, *exc):
        probes.LOG.paused = False


def rank0_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0's parameters and buffers, by name, on every rank (read before wrapping)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with _unlogged():
        for value in state.values():
            dist.broadcast(value, 0)
    return state


def wrapped_parameters(wrapper: nn.Module) -> dict[str, torch.Tensor]:
    module = getattr(wrapper, "module", wrapper)
    return {name.removeprefix("module."): p for name, p in module.named_parameters()}


def assert_close(rank: int, step: int, ours: dict[str, torch.Tensor], reference: nn.Module, what: str) -> None:
    for name, expected in reference.named_parameters():
        got = ours.get(name)
        assert got is not None, f"rank {rank}: no parameter named {name} {what}"
        got = got.detach().to(expected.dtype).reshape(expected.shape) if got.numel() == expected.numel() else got
        assert got.shape == expected.shape, (
            f"rank {rank}: parameter {name} has shape {tuple(got.shape)} {what}, expected {tuple(expected.shape)}")
        if not torch.allclose(got, expected.detach(), rtol=RTOL, atol=ATOL):
            diff = (got - expected).abs().max().item()
            raise AssertionError(f"rank {rank}, step {step}: parameter {name} differs from single-process "
                                 f"training by {diff:.3g} {what}")


def assert_sharded(results: list[dict], held: str, full: str, what: str) -> None:
    """Every rank holds at most 1/world size of ``full`` bytes, plus a quarter of the whole for a
    split by whole tensors (the suite's models split evenly by layers at world sizes 2 and 3)."""
    world_size = len(results)
    for rank, r in enumerate(results):
        share = r[held] / r[full]
        assert share <= 1 / world_size + 0.25, (
            f"rank {rank} holds {r[held]} bytes of {what}, {share:.0%} of the unsharded {r[full]}; "
            f"sharded, it holds about 1/{world_size}")


def train_ddp(ctx: Rank, case: DDPCase) -> dict:
    """Train ``case`` through the DDP adapters; the reductions issued per step, and during backward."""
    probes.install_collective_log()
    get, after = load_adapter(case.get), load_adapter(case.after_backward)
    start = load_adapter(case.train_batch_start) if case.train_batch_start else None
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # every rank differs, no seed repeats
    model = build(case.model)
    init = rank0_state(model)
    reference = build(case.model)
    reference.load_state_dict(init)
    kwargs = {} if case.bucket_size_mb is None else {"bucket_size_mb": case.bucket_size_mb}
    ddp = get(model, **kwargs)
    assert_close(ctx.rank, 0, wrapped_parameters(ddp), reference,
                 "after construction (every rank must start from rank 0's weights)")
    optimizer = make_optimizer(case.optimizer, ddp.parameters())
    ref_optimizer = make_optimizer(case.optimizer, reference.parameters())
    shard = slice(ctx.rank * BATCH // ctx.world_size, (ctx.rank + 1) * BATCH // ctx.world_size)
    reductions, during = [], []
    for step in range(case.steps):
        x, y = batch(step)
        ref_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_optimizer.step()

        if start is not None:
            start(ddp, optimizer)
        optimizer.zero_grad()
        mark = len(probes.LOG.calls)
        loss = F.mse_loss(ddp(x[shard]), y[shard])
        probes.mark_backward_start()
        loss.backward()
        probes.LOG.in_backward = False
        after(ddp, optimizer)
        optimizer.step()
        reductions.append(probes.LOG.reductions(mark))
        during.append(probes.LOG.reductions_during_backward(mark))
        assert_close(ctx.rank, step, wrapped_parameters(ddp), reference, "after the optimizer step")
    return {"reductions": reductions, "during_backward": during}


@dataclass(frozen=True)
class ZeroCase:
    optimizer: str = "adamw"
    steps: int = 3
    layers: int = 6  # equal layers: divisible by world sizes 2 and 3


def train_sharded_optimizer(ctx: Rank, case: ZeroCase) -> dict:
    """Every rank computes the whole batch's gradients, the sharded optimizer steps; its state bytes
    per rank beside a plain optimizer's."""
    probes.install_collective_log()
    get = load_adapter("get_sharded_optimizer")
    torch.manual_seed(shared_seed())
    model = Equal(layers=case.layers)
    reference = copy.deepcopy(model)
    cls = torch.optim.AdamW if case.optimizer == "adamw" else torch.optim.SGD
    kwargs = {"lr": 1e-2, "weight_decay": 0.1} if case.optimizer == "adamw" else {"lr": 0.1, "momentum": 0.9}
    optimizer = get(model.parameters(), cls, **kwargs)
    ref_optimizer = cls(reference.parameters(), **kwargs)
    for step in range(case.steps):
        x, y = batch(step)
        for net, opt in ((reference, ref_optimizer), (model, optimizer)):
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            opt.step()
        assert_close(ctx.rank, step, dict(model.named_parameters()), reference, "after the optimizer step")
    held = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    ref_held = {p.untyped_storage().data_ptr() for p in reference.parameters()}
    ref_held |= {p.grad.untyped_storage().data_ptr() for p in reference.parameters() if p.grad is not None}
    return {"state_bytes": probes.tensor_bytes_reachable(optimizer, held),
            "full_state_bytes": probes.tensor_bytes_reachable(ref_optimizer, ref_held)}


@dataclass(frozen=True)
class FSDPCase:
    optimizer: str = "sgd"
    steps: int = 3
    vocab: int = 37  # uneven shards at world sizes 2 and 3
    d_model: int = 20
    d_ff: int = 44


def _fsdp_model(case: FSDPCase) -> nn.Module:
    from cs336_basics.model import Embedding, Linear, RMSNorm  # the submission's own

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = Embedding(case.vocab, case.d_model)
            self.norm = RMSNorm(case.d_model)
            self.up = Linear(case.d_model, case.d_ff)
            self.down = Linear(case.d_ff, case.d_model)
            self.lm_head = Linear(case.d_model, case.vocab)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.norm(self.embedding(ids))
            h = h + self.down(torch.relu(self.up(h)))
            return self.lm_head(h)

    return LM()


def train_fsdp(ctx: Rank, case: FSDPCase) -> dict:
    """Train through the FSDP adapters; every rank's resident bytes beside the full parameters'."""
    probes.install_collective_log()
    get, after = load_adapter("get_fsdp"), load_adapter("fsdp_on_after_backward")
    gather = load_adapter("fsdp_gather_full_params")
    torch.manual_seed(shared_seed())  # FSDP starts from one seed on every rank, as the public tests do
    model = _fsdp_model(case)
    reference = copy.deepcopy(model)
    full_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    fsdp = get(model)
    optimizer = make_optimizer(case.optimizer, fsdp.parameters())
    ref_optimizer = make_optimizer(case.optimizer, reference.parameters())
    shard = slice(ctx.rank * BATCH // ctx.world_size, (ctx.rank + 1) * BATCH // ctx.world_size)
    for step in range(case.steps):
        g = torch.Generator().manual_seed(2000 + step)
        ids = torch.randint(0, case.vocab, (BATCH, 6), generator=g)
        labels = torch.randint(0, case.vocab, (BATCH, 6), generator=g)
        ref_optimizer.zero_grad()
        F.cross_entropy(reference(ids).flatten(0, 1), labels.flatten()).backward()
        ref_optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(fsdp(ids[shard]).flatten(0, 1), labels[shard].flatten()).backward()
        after(fsdp, optimizer)
        optimizer.step()
        assert_close(ctx.rank, step, gather(fsdp), reference, "(gathered) after the optimizer step")
    optimizer.zero_grad(set_to_none=True)
    grads = {p.grad.untyped_storage().data_ptr() for p in fsdp.parameters() if p.grad is not None}
    return {"resident_bytes": probes.tensor_bytes_reachable(fsdp, grads), "full_bytes": full_bytes}
