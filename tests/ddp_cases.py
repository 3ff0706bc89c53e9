"""Training cases for the DDP equivalence tests: models with every edge case, data, and runners.

A case trains one model for a few steps. ``run_ddp_cases`` runs many cases inside one spawned
process group (spawning costs seconds; a case costs milliseconds) and returns every rank's
parameters after every step. ``run_single_process`` trains the same case on the whole batch
without any ``torch.distributed`` call: the independent reference.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

import adapters
from cs336_systems.ddp import BucketedDDP
from cs336_systems.launch import RankContext

BATCH = 12  # divisible by world sizes 2 and 3
IN_FEATURES = 8
OUT_FEATURES = 6


class EdgeCaseModel(nn.Module):
    """Tied weights, a frozen bias, a never-trainable parameter, a parameter never used in
    forward, a buffer, and float64 next to float32 parameters."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(IN_FEATURES, 16, bias=False)
        self.hidden = nn.Linear(16, 16)
        self.hidden.bias.requires_grad_(False)
        self.hidden64 = nn.Linear(16, 16, dtype=torch.float64)
        self.decode = nn.Linear(16, IN_FEATURES, bias=False)
        self.re_encode = nn.Linear(IN_FEATURES, 16, bias=False)
        self.re_encode.weight = self.encode.weight  # tied: one parameter used twice
        self.head = nn.Linear(16, OUT_FEATURES)
        self.never_used = nn.Linear(4, 4)
        self.fixed = nn.Parameter(torch.full((3,), 2.0), requires_grad=False)
        # Random, so it differs per rank until the wrapper broadcasts rank 0's.
        self.register_buffer("scale", 0.5 + torch.rand(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.encode(x))
        h = F.relu(self.hidden(h)) * self.scale
        h = torch.tanh(self.hidden64(h.double())).float()
        h = F.relu(self.re_encode(self.decode(h)))
        return self.head(h)


class RoutedModel(nn.Module):
    """Each example goes to one expert by the sign of its first feature, so an expert can be
    used by some ranks' data and not others'; ``expert_never`` is used by no data at all."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(IN_FEATURES, 16)
        self.expert_neg = nn.Linear(16, OUT_FEATURES)
        self.expert_pos = nn.Linear(16, OUT_FEATURES)
        self.expert_never = nn.Linear(16, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.trunk(x))
        out = torch.zeros(x.shape[0], OUT_FEATURES, dtype=h.dtype)
        for expert, mask in (
            (self.expert_neg, x[:, 0] < 0),
            (self.expert_pos, x[:, 0] >= 0),
            (self.expert_never, x[:, 0] > 1e9),
        ):
            if mask.any():  # a branch not taken adds nothing to the graph
                out = out.index_put((mask.nonzero().squeeze(1),), expert(h[mask]))
        return out


MODELS = {"edge": EdgeCaseModel, "routed": RoutedModel}


@dataclass(frozen=True)
class Case:
    """One training run, identical in the DDP ranks and in the single-process reference."""

    name: str
    variant: str  # "naive", "flat", "per-parameter" or "bucketed"
    model: str  # key of MODELS
    optimizer: str  # "sgd" (momentum 0.9) or "adamw"
    bucket_size_mb: float | str | None = None  # bucketed only; "auto" calibrates
    accumulate: bool = False  # two micro-batches per step, the first under no_sync()
    steps: int = 3
    seed: int = 0
    set_to_none: bool = True  # zero_grad(set_to_none=...): False accumulates into bucket views
    bucket_options: tuple[tuple[str, object], ...] = ()  # BucketedDDP levers, as (name, value)
    atol: float = 1e-5  # tolerance against the single-process reference (see the tests)


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    raise ValueError(f"unknown optimizer {kind!r}")


def wrap(case: Case, module: nn.Module) -> nn.Module:
    if case.variant == "naive":
        return adapters.get_ddp_naive(module)
    if case.variant == "flat":
        return adapters.get_ddp_flat(module)
    if case.variant == "per-parameter":
        return adapters.get_ddp_individual_parameters(module)
    if case.variant == "bucketed" and case.bucket_options:
        return BucketedDDP(module, bucket_size_mb=case.bucket_size_mb, **dict(case.bucket_options))
    if case.variant == "bucketed":
        return adapters.get_ddp_bucketed(module, bucket_size_mb=case.bucket_size_mb)
    raise ValueError(f"unknown variant {case.variant!r}")


def batch(case: Case, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of one (micro-)step; every rank and the reference build the same one."""
    g = torch.Generator().manual_seed(10_000 * case.seed + 100 * step + micro)
    x = torch.randn(BATCH, IN_FEATURES, generator=g)
    y = torch.randn(BATCH, OUT_FEATURES, generator=g)
    if case.model == "routed" and step % 2 == 0:
        # The first half of the batch (all of rank 0's shard at world size 2 or 3) never
        # reaches expert_pos, which the other half uses: used elsewhere, not on rank 0.
        x[: BATCH // 2, 0] = -x[: BATCH // 2, 0].abs() - 0.1
    return x, y


def build_model(case: Case, rank: int) -> nn.Module:
    torch.manual_seed(1_000 * (case.seed + 1) + rank)  # ranks start different on purpose
    return MODELS[case.model]()


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def run_single_process(case: Case) -> list[dict[str, torch.Tensor]]:
    """Train on the whole batch in this process; the parameters after every step."""
    model = build_model(case, rank=0)
    optimizer = make_optimizer(case.optimizer, model.parameters())
    history = []
    for step in range(case.steps):
        optimizer.zero_grad(set_to_none=case.set_to_none)
        micro_batches = [batch(case, step, m) for m in range(2 if case.accumulate else 1)]
        x = torch.cat([mb[0] for mb in micro_batches])
        y = torch.cat([mb[1] for mb in micro_batches])
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        history.append(snapshot(model))
    return history


def _run_ddp_case(ctx: RankContext, case: Case) -> dict:
    module = build_model(case, ctx.rank)
    ddp = wrap(case, module)
    optimizer = make_optimizer(case.optimizer, ddp.parameters())
    shard = BATCH // ctx.world_size
    rows = slice(ctx.rank * shard, (ctx.rank + 1) * shard)
    history, calls = [], []
    for step in range(case.steps):
        optimizer.zero_grad(set_to_none=case.set_to_none)
        n_micro = 2 if case.accumulate else 1
        for micro in range(n_micro):
            x, y = batch(case, step, micro)
            if micro < n_micro - 1:
                with ddp.no_sync():
                    (F.mse_loss(ddp(x[rows]), y[rows]) / n_micro).backward()
                ddp.finish_gradient_synchronization()  # inside no_sync's step: must be a no-op
            else:
                (F.mse_loss(ddp(x[rows]), y[rows]) / n_micro).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
        history.append(snapshot(module))
        calls.append(ddp.allreduce_calls_last_step)
    buckets = len(ddp.buckets) if hasattr(ddp, "buckets") else None
    cap = getattr(ddp, "bucket_cap_bytes", None)
    tuned = getattr(ddp, "tuning_result", None)
    candidates = None if tuned is None else list(tuned.caps)
    return {"history": history, "calls": calls, "buckets": buckets, "bucket_cap_bytes": cap,
            "auto_candidates": candidates}


def run_ddp_cases(ctx: RankContext, cases: list[Case]) -> dict[str, dict]:
    """Rank function: run every case on this rank. A case that raises fails the whole group
    (its peers may be blocked in a collective, so going on to the next case is unsafe)."""
    return {case.name: _run_ddp_case(ctx, case) for case in cases}


SHARED_MODULE_WRAPPERS = ("naive", "flat", "per-parameter", "bucketed")


def run_wrappers_sharing_one_module(ctx: RankContext, case: Case) -> list[dict[str, torch.Tensor]]:
    """Rank function: one module wrapped by every variant at once (as the step benchmark does),
    step ``i`` trained through wrapper ``i mod 4``; the parameters after every step."""
    module = build_model(case, ctx.rank)
    wrappers = [wrap(replace(case, variant=v), module) for v in SHARED_MODULE_WRAPPERS]
    optimizer = make_optimizer(case.optimizer, module.parameters())
    shard = BATCH // ctx.world_size
    rows = slice(ctx.rank * shard, (ctx.rank + 1) * shard)
    history = []
    for step in range(case.steps):
        ddp = wrappers[step % len(wrappers)]
        optimizer.zero_grad(set_to_none=case.set_to_none)
        x, y = batch(case, step, 0)
        F.mse_loss(ddp(x[rows]), y[rows]).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
        history.append(snapshot(module))
    return history
