"""Does DDP training equal single-process training? The check behind ``scripts/naive_ddp.py``.

Problem 2 asks for evidence that naive DDP (broadcast rank 0's weights, shard the batch,
average gradients, step) produces the same weights as one process training on the whole
batch. :func:`compare_with_single_process` trains a toy model both ways from the same initial
weights and data and reports the largest parameter difference after every step, as one
:class:`EquivalenceRecord` (``naive_ddp.json``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cs336_systems import cli
from cs336_systems.bench.workload import shard_rows
from cs336_systems.ddp import VARIANTS
from cs336_systems.launch import RankContext, launch, running_under_launcher
from cs336_systems.results.schema import Record

# The variants that synchronise after backward, as problem 2's naive DDP does (keys of ddp.VARIANTS).
EQUIVALENCE_VARIANTS = ("naive", "flat")
IN_FEATURES, OUT_FEATURES = 16, 4
LEARNING_RATE = 0.05


@dataclass(frozen=True)
class EquivalenceSetting:
    """The comparison: which variant, on how many gloo ranks, for how many steps, within what tolerance."""

    variant: str = field(default="naive", metadata=cli.choice("DDP variant compared", EQUIVALENCE_VARIANTS))
    world_size: int = field(default=2, metadata=cli.count(
        "gloo ranks spawned on this machine (at least 2: one rank has nothing to synchronise)", minimum=2,
        maximum=cli.MAX_RANKS))
    steps: int = field(default=10, metadata=cli.count("optimizer steps compared"))
    global_batch: int = field(default=32, metadata=cli.count("examples per step over all ranks"))
    seed: int = field(default=0, metadata=cli.count("seed of the initial weights (rank 0's) and the data", minimum=0))
    # float32 rounding of per-rank partial sums is ~1e-7; a wrong gradient is ~1e-2.
    atol: float = field(default=1e-5, metadata=cli.nonnegative("largest |DDP - single-process| accepted"))

    def validate(self) -> None:
        """ValueError for a comparison that cannot run, before any process starts."""
        cli.check_fields(self)
        shard_rows(self.global_batch, 0, self.world_size)
        if running_under_launcher():
            # It compares every rank's parameters, so it must own all of them.
            raise ValueError("the equivalence check spawns its own ranks: run it as a plain command, "
                             "not under torchrun or SLURM")


@dataclass(frozen=True)
class EquivalenceRecord(Record):
    """The comparison's setting and what it found."""

    KIND: ClassVar[str] = "naive_ddp"
    VERSION: ClassVar[int] = 1

    variant: str
    world_size: int
    steps: int
    global_batch: int
    seed: int
    atol: float
    max_abs_diff_per_step: list[float]  # largest |DDP - single| over parameters and ranks, after each step
    max_abs_diff: float  # over all steps
    ranks_identical: bool  # all ranks hold bitwise-equal parameters after the last step

    @property
    def match(self) -> bool:
        """Every step within the tolerance, and the ranks in agreement."""
        return self.max_abs_diff <= self.atol and self.ranks_identical


def toy_model() -> nn.Module:
    hidden = 32
    return nn.Sequential(nn.Linear(IN_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, OUT_FEATURES))


def _data(setting: EquivalenceSetting, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(setting.seed * 1_000_003 + step)
    x = torch.randn(setting.global_batch, IN_FEATURES, generator=g)
    return x, torch.randn(setting.global_batch, OUT_FEATURES, generator=g)


def _train_ddp(ctx: RankContext, setting: EquivalenceSetting) -> list[dict[str, torch.Tensor]]:
    rows = shard_rows(setting.global_batch, ctx.rank, ctx.world_size)
    torch.manual_seed(setting.seed + 100 * ctx.rank)  # differs per rank: DDP must broadcast
    ddp = VARIANTS[setting.variant].wrap(toy_model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATE)
    history = []
    for step in range(setting.steps):
        x, y = _data(setting, step)
        optimizer.zero_grad()
        F.mse_loss(ddp(x[rows]), y[rows]).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
        history.append({n: p.detach().clone() for n, p in ddp.module.named_parameters()})
    return history


def _train_single(setting: EquivalenceSetting) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(setting.seed)  # rank 0's seed: the weights DDP broadcasts
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    history = []
    for step in range(setting.steps):
        x, y = _data(setting, step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history


def compare_with_single_process(setting: EquivalenceSetting) -> EquivalenceRecord:
    """Train both ways (gloo ranks spawned here) and compare after every step."""
    setting.validate()
    per_rank = launch(_train_ddp, setting.world_size, args=(setting,), backend="gloo", device_type="cpu")
    reference = _train_single(setting)
    diffs = [
        max((history[step][n] - p).abs().max().item() for history in per_rank for n, p in expected.items())
        for step, expected in enumerate(reference)
    ]
    last = [history[-1] for history in per_rank]
    identical = all(torch.equal(h[n], last[0][n]) for h in last for n in last[0])
    return EquivalenceRecord(setting.variant, setting.world_size, setting.steps, setting.global_batch, setting.seed,
                             setting.atol, diffs, max(diffs), identical)
