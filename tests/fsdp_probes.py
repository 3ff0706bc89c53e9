"""What the FSDP tests observe inside a rank beyond training: misuse errors, memory, overlap.

The memory probe watches collectives through a ``TorchDispatchMode``: every all-gather output
is a gathered full weight, whose bytes count as live until its storage is freed or emptied. Every reduce-scatter
is stamped with the phase it was launched in (forward, backward or finish), which shows
whether gradient reductions overlap backward. Nothing here reads FSDP's internals.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import adapters
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

    def live_bytes(self) -> int:
        return sum(s.nbytes() for ref in self.storages if (s := ref()) is not None)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.peak.setdefault(phase, self.live_bytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.c10d._allgather_base_.default:
            self.storages.append(weakref.ref(args[0].untyped_storage()))
            self.peak[self.phase] = max(self.peak.get(self.phase, 0), self.live_bytes())
        elif func is torch.ops.c10d._reduce_scatter_base_.default:
            self.reductions.append(self.phase)
        return out


def probe_memory_and_overlap(ctx: RankContext, width: int = 96, depth: int = 6) -> dict:
    """Two steps of a stack of equal layers under the watcher: gathered bytes and reductions."""
    torch.manual_seed(ctx.rank)
    fsdp = adapters.get_fsdp(LayerStack(width, depth))
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
        steps.append({"peak": dict(watcher.peak), "reductions": list(watcher.reductions)})
    return {
        "layer_bytes": width * width * 4,
        "model_bytes": depth * width * width * 4,
        "shard_bytes": sum(p.numel() * p.element_size() for p in fsdp.parameters()),
        "depth": depth,
        "steps": steps,
    }


def misuse_after_init(ctx: RankContext) -> dict[str, str]:
    """Forward and optimizer step before finishing the previous backward: the errors raised."""
    case = CASES[0]
    fsdp = adapters.get_fsdp(build_model(case, ctx.rank))
    optimizer = make_optimizer(case.optimizer, fsdp.parameters())
    tokens, targets = batch(case, 0)
    rows = slice(ctx.rank * (BATCH // ctx.world_size), (ctx.rank + 1) * (BATCH // ctx.world_size))
    loss_of(fsdp(tokens[rows]), targets[rows]).backward()
    errors = {}
    try:
        fsdp(tokens[rows])
    except RuntimeError as e:
        errors["forward"] = str(e)
    try:
        optimizer.step()
    except RuntimeError as e:
        errors["step"] = str(e)
    adapters.fsdp_on_after_backward(fsdp, optimizer)
    optimizer.step()  # finishing makes both legal again
    loss_of(fsdp(tokens[rows]), targets[rows]).backward()
    adapters.fsdp_on_after_backward(fsdp, optimizer)
    return errors
