"""The 2-rank job of issue 27: three training steps with one of our wrappers, then the group is
destroyed and the rank returns. Finished ranks of this job used to die at exit with SIGABRT
(cs336_systems/launch/lifetime.py). Kept small: a spawned rank imports only this, torch and
the library.

``WRAPPERS`` builds each of our wrappers (the FSDP and the sharded optimizer with their plain
partner) as the adapters do; :func:`train_and_release` trains and releases one.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

import adapters
from cs336_systems.launch import RankContext, find_free_port, gloo_workers_alive, teardown

STEPS = 3


def _ddp(wrap: Callable[[nn.Module], nn.Module]):
    def build(model: nn.Module):
        wrapped = wrap(model)
        return wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1)
    return build


def _sharded_optimizer(model: nn.Module):
    wrapped = adapters.get_ddp_bucketed(model, 1000.0)
    return wrapped, adapters.get_sharded_optimizer(wrapped.parameters(), torch.optim.AdamW, lr=1e-3)


WRAPPERS: dict[str, Callable[[nn.Module], tuple[nn.Module, torch.optim.Optimizer]]] = {
    "naive": _ddp(adapters.get_ddp_naive),
    "flat": _ddp(adapters.get_ddp_flat),
    "per-parameter": _ddp(adapters.get_ddp_individual_parameters),
    "bucketed-1000MB": _ddp(lambda m: adapters.get_ddp_bucketed(m, 1000.0)),
    "bucketed-auto": _ddp(lambda m: adapters.get_ddp_bucketed(m, "auto")),
    "fsdp": _ddp(adapters.get_fsdp),
    "sharded-optimizer": _sharded_optimizer,
}


def train_and_release(name: str, rank: int) -> None:
    """Three steps of the toy model with wrapper ``name`` on this rank's half of the batch."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(10, 50), nn.ReLU(), nn.Linear(50, 5))
    wrapped, optimizer = WRAPPERS[name](model)
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        x = torch.randn(8, 10)[rank * 4 : rank * 4 + 4]
        optimizer.zero_grad()
        wrapped(x).pow(2).mean().backward()
        wrapped.finish_gradient_synchronization()
        optimizer.step()
    wrapped.release()
    optimizer_release = getattr(optimizer, "release", None)
    if optimizer_release is not None:
        optimizer_release()


def launched_job(ctx: RankContext, name: str) -> None:
    """One rank under the repo's launcher (launch() tears the group down and exits the rank)."""
    torch.set_num_threads(1)
    train_and_release(name, ctx.rank)


def spawned_job(rank: int, world_size: int, port: int, name: str) -> None:
    """One rank under ``torch.multiprocessing.spawn``, set up and torn down as the public tests
    do through tests/common.py; the rank then returns and the interpreter finalizes."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    train_and_release(name, rank)
    teardown()


def workers_after_teardown(ctx: RankContext) -> dict[str, int]:
    """Per wrapper, in a group of its own: the gloo worker threads left after its teardown.

    0 means the wrapper let its group be freed, and the group's workers be joined, before
    interpreter exit; anything else is a group whose workers live on into finalization.
    """
    counts = {}
    for i, name in enumerate(WRAPPERS):
        if i:
            dist.init_process_group("gloo", rank=ctx.rank, world_size=ctx.world_size,
                                    timeout=timedelta(seconds=60))
        train_and_release(name, ctx.rank)
        next_port = [find_free_port() if ctx.rank == 0 else 0]  # for the next wrapper's group
        dist.broadcast_object_list(next_port, src=0)
        teardown()
        counts[name] = gloo_workers_alive()
        os.environ["MASTER_PORT"] = str(next_port[0])
    return counts
