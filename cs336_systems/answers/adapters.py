"""The handout's adapters (tests/adapters.py of both editions), bound to the answers.

Spring 2025 names: get_ddp_individual_parameters, ddp_individual_parameters_on_after_backward,
get_ddp_bucketed, ddp_bucketed_on_after_backward, ddp_bucketed_on_train_batch_start,
get_sharded_optimizer. The 2026 edition calls the per-parameter DDP get_ddp /
ddp_on_after_backward and adds get_fsdp, fsdp_on_after_backward, fsdp_gather_full_params.
The repository's top-level adapters.py serves these when CS336_IMPL=answers.
"""

from typing import Any

import torch

# Imported before any test creates its process group, so that torch does not pin the default
# group until interpreter exit, where gloo's workers can abort a finished rank (cs336_systems/launch/README.md: "Ranks
# that die at exit").
import torch.distributed.nn  # noqa: F401

# Each adapter imports its answer when called: an error in one answer's file (or the FSDP's
# cs336_basics, which the 2025 edition lacks) then costs only the tests of that problem.


def get_ddp_naive(module: torch.nn.Module) -> torch.nn.Module:
    """Not a handout adapter: the naive answer, which the 2026 handout also tests through get_ddp."""
    from cs336_systems.answers.naive_ddp import NaiveDDP

    return NaiveDDP(module)


def get_ddp_individual_parameters(module: torch.nn.Module) -> torch.nn.Module:
    from cs336_systems.answers.ddp_overlap_individual_parameters import DDPIndividualParameters

    return DDPIndividualParameters(module)


def ddp_individual_parameters_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def get_ddp(module: torch.nn.Module) -> torch.nn.Module:
    """The 2026 edition's name for the per-parameter DDP."""
    return get_ddp_individual_parameters(module)


def ddp_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def get_ddp_bucketed(module: torch.nn.Module, bucket_size_mb: float | None) -> torch.nn.Module:
    from cs336_systems.answers.ddp_bucketed import DDPBucketed

    return DDPBucketed(module, bucket_size_mb)


def ddp_bucketed_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def ddp_bucketed_on_train_batch_start(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Optional in the handout; nothing to do: the wrapper's forward starts each step afresh."""


def get_sharded_optimizer(params, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> torch.optim.Optimizer:
    from cs336_systems.answers.sharded_optimizer import ShardedOptimizer

    return ShardedOptimizer(params, optimizer_cls, **kwargs)


def get_fsdp(module: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    from cs336_systems.answers.fsdp import FSDP

    return FSDP(module, compute_dtype)


def fsdp_on_after_backward(fsdp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return fsdp_model.gather_full_params()
