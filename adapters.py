"""The functions the public CS336 assignment-2 test suite calls, wired to this repo's library.

Names and parameter names follow that suite exactly (it passes some arguments by keyword);
``tests/adapters.py`` re-exports everything here so its test files run unchanged.

One switch, the environment variable ``CS336_IMPL``, picks what the handout's adapters call:

    CS336_IMPL=library  (the default) this repository's library: ddp/, zero/, fsdp/
    CS336_IMPL=answers  the one-file answers in cs336_systems/answers/ (read those first)

e.g. ``CS336_IMPL=answers .venv/bin/pytest tests/test_ddp.py``. The adapters beyond the handout
(get_ddp_flat, get_fsdp_exact) always call the library; get_ddp_naive follows the switch.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import torch

# Imported before the public tests' ranks call init_process_group: it keeps torch from pinning
# the default group until interpreter exit, where gloo's workers could abort a finished rank
# (cs336_systems/launch/lifetime.py).
import cs336_systems.launch.lifetime  # noqa: F401
from cs336_systems.ddp import VARIANTS
from cs336_systems.fsdp import FullyShardedDataParallel
from cs336_systems.zero import ShardedOptimizer


def get_ddp(module: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``module`` in DDP that all-reduces each parameter's gradient as soon as it is ready
    (the 2026 suite's name for the individual-parameters variant)."""
    return VARIANTS["per-parameter"].wrap(module)


def ddp_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After backward, before the optimizer step: wait for every gradient's all-reduce."""
    ddp_model.finish_gradient_synchronization()


def get_fsdp(module: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Wrap ``module`` in FSDP: Linear/Embedding weights sharded, gathered just in time.

    ``compute_dtype`` (float16 or bfloat16) is the dtype weights are gathered and computed in;
    master shards and their gradients stay float32.
    """
    # The library's default reduce-scatter FSDP, as the handout describes: each rank
    # backpropagates only its own rows and its weight gradients are reduce-scattered to shards.
    # It equals single-process training within float32 rounding, not bitwise: per-rank partial
    # gradients summed by the reduce-scatter add in another order than one whole-batch matmul
    # (torch's fully_shard too). The public 2026.1.2+ tests compare with allclose, and pass.
    # FullyShardedDataParallel(..., exact_gradients=True) is bitwise equal (26.1.1's torch.equal)
    # at the cost described in cs336_systems/fsdp/__init__.py; no adapter uses it by default.
    return FullyShardedDataParallel(module, compute_dtype=compute_dtype)


def get_fsdp_exact(
    module: torch.nn.Module, compute_dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """Wrap ``module`` in FSDP's exact-gradient mode: every rank recomputes each weight gradient
    over the all-gathered global batch, so training is bitwise equal to one process (our tests)."""
    return FullyShardedDataParallel(module, compute_dtype=compute_dtype, exact_gradients=True)


def fsdp_on_after_backward(fsdp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After backward, before the optimizer step: wait for every reduction, install shard grads."""
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value, by its name in the wrapped module (all ranks must call)."""
    return fsdp_model.gather_full_params()


# Beyond the public suite: the two non-overlapped variants, so our tests reach every variant
# through this file.
def get_ddp_naive(module: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``module`` in DDP that all-reduces each gradient after backward, one call each."""
    return VARIANTS["naive"].wrap(module)


def get_ddp_flat(module: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``module`` in DDP that all-reduces all gradients flattened into one buffer."""
    return VARIANTS["flat"].wrap(module)


def get_ddp_individual_parameters(module: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``module`` in DDP that all-reduces each parameter's gradient as soon as it is ready."""
    return VARIANTS["per-parameter"].wrap(module)


def ddp_individual_parameters_on_after_backward(
    ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """After backward, before the optimizer step: wait for every gradient's all-reduce."""
    ddp_model.finish_gradient_synchronization()


def get_ddp_bucketed(module: torch.nn.Module, bucket_size_mb: float | None) -> torch.nn.Module:
    """Wrap ``module`` in DDP that all-reduces buckets of at most ``bucket_size_mb`` MiB."""
    return VARIANTS["bucketed"].wrap(module, bucket_size_mb=bucket_size_mb)


def ddp_bucketed_on_after_backward(
    ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """After backward, before the optimizer step: wait for every bucket's all-reduce."""
    ddp_model.finish_gradient_synchronization()


def ddp_bucketed_on_train_batch_start(
    ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """At the start of a training step: check the previous step was finished."""
    ddp_model.on_train_batch_start()


def get_sharded_optimizer(
    params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
) -> torch.optim.Optimizer:
    """An optimizer that keeps only this rank's shard of ``optimizer_cls``'s state (ZeRO-1)."""
    return ShardedOptimizer(params, optimizer_cls, **kwargs)


IMPLEMENTATIONS = ("library", "answers")
IMPL = os.environ.get("CS336_IMPL", "library")
if IMPL not in IMPLEMENTATIONS:
    raise ValueError(f"CS336_IMPL must be one of {IMPLEMENTATIONS}, got {IMPL!r}")
if IMPL == "answers":
    from cs336_systems.answers.adapters import (  # noqa: E402, F811 (the switch: these replace the above)
        ddp_bucketed_on_after_backward,
        ddp_bucketed_on_train_batch_start,
        ddp_individual_parameters_on_after_backward,
        ddp_on_after_backward,
        fsdp_gather_full_params,
        fsdp_on_after_backward,
        get_ddp,
        get_ddp_bucketed,
        get_ddp_individual_parameters,
        get_ddp_naive,
        get_fsdp,
        get_sharded_optimizer,
    )
