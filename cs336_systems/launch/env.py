"""Joining a process group from torchrun-style environment variables, and leaving it.

Under ``torchrun`` (or SLURM through ``scripts/submit_slurm.py``) the launcher sets RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; :func:`init_from_env`
reads them. Every process group gets a timeout, so a rank that dies or skips a collective ends
the run with an error instead of leaving the others waiting forever.
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist

from cs336_systems.launch.context import DEFAULT_TIMEOUT_S, RankContext, check_devices, select_device
# Imported before any process group exists (lifetime.py says why).
from cs336_systems.launch.lifetime import unpin_default_group

_RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from e


def running_under_launcher() -> bool:
    """True when torchrun (or SLURM through our submitter) has set the rendezvous variables."""
    return all(name in os.environ for name in _RENDEZVOUS_VARS)


def launched_world_size() -> int | None:
    """The launcher's WORLD_SIZE, or None when this process was not started by one."""
    return _env_int("WORLD_SIZE") if running_under_launcher() else None


def ranks_on_this_node(world_size: int) -> int:
    """LOCAL_WORLD_SIZE under a launcher; ``world_size`` when every rank is spawned here."""
    return _env_int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ else world_size


def init_from_env(
    backend: str | None = None,
    device_type: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> RankContext:
    """Initialise the default process group from torchrun-style environment variables.

    Reads RANK, WORLD_SIZE, LOCAL_RANK (defaults to RANK), LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT. ``backend=None`` picks NCCL on GPU and gloo on CPU.
    """
    missing = [name for name in _RENDEZVOUS_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"cannot initialise the process group: environment variables {missing} are not set; "
            "run under torchrun, or use cs336_systems.launch.launch() to spawn ranks"
        )
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE={world_size}), got {rank}")
    local_world_size = ranks_on_this_node(world_size)
    device_type, backend = check_devices(device_type, backend, local_world_size)
    device = select_device(local_rank, device_type)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    return RankContext(rank, world_size, local_rank, device, backend, local_world_size)


def teardown(clean: bool = True) -> None:
    """Leave the process group: wait for every rank (``clean``), then destroy it.

    The barrier keeps rank 0 (which hosts the rendezvous store) alive until the others are done
    with it; the group's timeout bounds the wait if a peer is gone. After an error, pass
    ``clean=False``: waiting for peers would only delay (and hide) the error being raised.
    """
    if not dist.is_initialized():
        return
    try:
        if clean:
            dist.barrier()
    finally:
        dist.destroy_process_group()
        # Free the group now, and join its gloo workers, rather than during interpreter
        # finalization (lifetime.py): unpin it, and collect a user's model that holds it in a
        # reference cycle.
        unpin_default_group()
        gc.collect()


def run_then_teardown(
    fn: Callable[..., Any],
    ctx: RankContext,
    args: Sequence[Any],
    on_error: Callable[[], None] | None = None,
) -> Any:
    """``fn(ctx, *args)``, then leave the group (without waiting for peers after an error)."""
    try:
        result = fn(ctx, *args)
    except BaseException:
        if on_error is not None:
            on_error()
        teardown(clean=False)
        raise
    teardown()
    return result
