"""What the FSDP tests observe inside a rank beyond training: misuse errors, memory, overlap.

The memory probe watches collectives through a ``TorchDispatchMode``: every one-dimensional
all-gather output is a gathered full weight (FSDP gathers flat shards), whose bytes count as
live until its storage is freed or emptied; exact mode's gathers of activations and output
gradients keep their batch shape and are only counted. Every reduce-scatter and every
activation gather is stamped with the phase it was launched in (forward, backward or finish),
which shows whether gradient work overlaps backward. Nothing here reads FSDP's internals.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import adapters
from cs336_basics.model import Linear
from cs336_systems.launch import RankContext
from tests.fsdp_cases import CASES, BATCH, LayerStack, batch, build_model, loss_of, make_optimizer


class CollectiveWatcher(TorchDispatchMode):
    """Peak live bytes of all-gathered buffers per phase, and the phase of each reduce-scatter.

    Live bytes are re-counted at each all-gather (the only moment they grow) from weak
    references to every gathered storage: one freed, or shrunk to nothing, counts 0.
    """

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.storages: list[weakref.ref] = []
        self.peak: dict[str, int] = {}
        self.reductions: list[str] = []
        self.activation_gathers: list[str] = []

    def live_bytes(self) -> int:
        return sum(s.nbytes() for ref in self.storages if (s := ref()) is not None)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.peak.setdefault(phase, self.live_bytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.c10d._allgather_base_.default and args[0].dim() > 1:
            self.activation_gathers.append(self.phase)
        elif func is torch.ops.c10d._allgather_base_.default:
            self.storages.append(weakref.ref(args[0].untyped_storage()))
            self.peak[self.phase] = max(self.peak.get(self.phase, 0), self.live_bytes())
        elif func is torch.ops.c10d._reduce_scatter_base_.default:
            self.reductions.append(self.phase)
        return out


def probe_memory_and_overlap(ctx: RankContext, exact: bool, width: int = 96, depth: int = 6) -> dict:
    """Two steps of a stack of equal layers under the watcher: gathered bytes and reductions."""
    torch.manual_seed(ctx.rank)
    get = adapters.get_fsdp_exact if exact else adapters.get_fsdp
    fsdp = get(LayerStack(width, depth))
    optimizer = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    x = torch.randn(4, width)
    steps = []
    for _ in range(2):
        watcher = CollectiveWatcher()
        with watcher:
            watcher.set_phase("forward")
            loss = fsdp(x).square().mean()
            watcher.set_phase("backward")
            loss.backward()
            watcher.set_phase("finish")
            adapters.fsdp_on_after_backward(fsdp, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append({
            "peak": dict(watcher.peak),
            "reductions": list(watcher.reductions),
            "activation_gathers": list(watcher.activation_gathers),
        })
    return {
        "layer_bytes": width * width * 4,
        "model_bytes": depth * width * width * 4,
        "shard_bytes": sum(p.numel() * p.element_size() for p in fsdp.parameters()),
        "depth": depth,
        "steps": steps,
    }


def backward_ends_the_step(ctx: RankContext) -> dict:
    """Backward alone installs the shards' gradients (no call after it, as torch's FSDP); the
    adapters' explicit finish afterwards changes none of them; forward and the optimizer step
    need nothing in between."""
    case = CASES[0]
    fsdp = adapters.get_fsdp(build_model(case, ctx.rank))
    optimizer = make_optimizer(case.optimizer, fsdp.parameters())
    tokens, targets = batch(case, 0)
    rows = slice(ctx.rank * (BATCH // ctx.world_size), (ctx.rank + 1) * (BATCH // ctx.world_size))
    loss_of(fsdp(tokens[rows]), targets[rows]).backward()
    trainable = [p for p in fsdp.parameters() if p.requires_grad]
    installed = all(p.grad is not None for p in trainable)
    before = [p.grad.clone() for p in trainable if p.grad is not None]
    adapters.fsdp_on_after_backward(fsdp, optimizer)
    unchanged = all(torch.equal(b, p.grad) for b, p in zip(before, trainable))
    fsdp(tokens[rows])  # a forward right after backward: nothing pending
    optimizer.step()
    return {"installed": installed, "unchanged_by_finish": unchanged}


class _KeywordCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x=x)


class _InPlaceAfterUse(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = Linear(4, 4), Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        out = self.second(h)
        h.mul_(2)  # the input second's gradient would be recomputed from, changed after its use
        return out + h


def exact_mode_misuse(ctx: RankContext) -> dict[str, str]:
    """What exact mode says to a layer called with keywords and to an input changed in place.

    Each wrapper is dropped after its error: every rank fails at the same point, so the
    collectives stay paired, but the wrapper is left mid-step.
    """
    errors = {}
    x = torch.randn(2, 4)
    try:
        adapters.get_fsdp_exact(_KeywordCall())(x)
    except TypeError as e:
        errors["keywords"] = str(e)
    try:
        adapters.get_fsdp_exact(_InPlaceAfterUse())(x).sum().backward()
    except RuntimeError as e:
        errors["in_place"] = str(e)
    return errors



def probe_backward_flops(ctx: RankContext, width: int = 32, depth: int = 3, rows: int = 4) -> dict:
    """Matmul FLOPs of one backward on this rank's ``rows`` rows: ``get_fsdp``'s, exact mode's,
    and the same stack's without FSDP on the same rows (what data parallelism does per rank).

    Also the mode ``get_fsdp`` builds and whether its backward all-gathered anything with a batch
    dimension (activations or output gradients: exact mode's, never data parallelism's).
    """
    from torch.utils.flop_counter import FlopCounterMode

    def backward_flops(model: nn.Module, watcher: CollectiveWatcher | None = None) -> int:
        loss = model(torch.randn(rows, width)).square().mean()
        with FlopCounterMode(display=False) as counter:
            if watcher is None:
                loss.backward()
            else:
                with watcher:
                    watcher.set_phase("backward")
                    loss.backward()
        if model is not plain_model:
            adapters.fsdp_on_after_backward(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return counter.get_total_flops()

    torch.manual_seed(ctx.rank)
    plain_model = LayerStack(width, depth)
    watcher = CollectiveWatcher()
    fsdp = adapters.get_fsdp(LayerStack(width, depth))
    return {
        "plain": backward_flops(plain_model),
        "fsdp": backward_flops(fsdp, watcher),
        "exact": backward_flops(adapters.get_fsdp_exact(LayerStack(width, depth))),
        "mode": fsdp.mode,
        "activation_gathers": list(watcher.activation_gathers),
    }
