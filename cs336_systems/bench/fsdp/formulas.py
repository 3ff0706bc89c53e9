"""What each configuration should move per step, and the largest model its memory would fit.

Bytes per rank. A collective moves a *payload*: the full buffer (an all-gather's output, a
reduce-scatter's input, an all-reduce's or broadcast's tensor). With the bandwidth-optimal ring
algorithms (Patarasuk and Yuan, 2009; the accounting nccl-tests' busbw uses) each rank sends
(n-1)/n of an all-gather's or reduce-scatter's payload and 2(n-1)/n of an all-reduce's, and on
average over the ranks receives (n-1)/n of a broadcast's. With B the model's parameter bytes:

* DDP: one all-reduce of every gradient, 2(n-1)/n B;
* DDP + the sharded optimizer: the same, plus each owner broadcasting its updated parameters, (n-1)/n B more;
* FSDP: every weight all-gathered for forward and again for backward and its gradient
  reduce-scattered, 3(n-1)/n B: 1.5 times DDP (the ZeRO paper, Rajbhandari et al., 2020, sec. 7).

The measured bytes differ from these where a weight is not gathered again for backward (an
embedding's backward needs only its input, not its weight; torch's FSDP keeps the root
module's weights gathered after forward) and by the few replicated parameters.
"""

from __future__ import annotations

import torch

from cs336_basics.model import MODEL_SIZES, expected_parameter_count
from cs336_systems.zero import parameter_bytes
from cs336_systems.bench.fsdp.record import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE_SCATTER

DDP, ZERO1, FSDP, TORCH_FSDP = "ddp", "zero1", "fsdp", "torch-fsdp"


def traffic_factors(world_size: int) -> dict[str, float]:
    """Bytes each rank sends (receives, for a broadcast) per payload byte, by collective kind."""
    share = (world_size - 1) / world_size
    return {ALL_GATHER: share, REDUCE_SCATTER: share, ALL_REDUCE: 2 * share, BROADCAST: share}


def traffic_bytes(payload_bytes: dict[str, float], world_size: int) -> float:
    """Per-rank bytes of a step's collectives, from their payloads by kind."""
    factors = traffic_factors(world_size)
    return sum(factors[kind] * size for kind, size in payload_bytes.items())


def formula_traffic_bytes(configuration: str, parameter_bytes: float, world_size: int) -> float:
    """The textbook per-rank bytes of one step (see the module docstring)."""
    share = (world_size - 1) / world_size
    times_share = {DDP: 2.0, ZERO1: 3.0, FSDP: 3.0, TORCH_FSDP: 3.0}
    if configuration not in times_share:
        raise ValueError(f"unknown configuration {configuration!r}; known: {', '.join(times_share)}")
    return times_share[configuration] * share * parameter_bytes


def largest_parameters(bytes_per_parameter: float, activation_bytes: float, free_bytes: float) -> float:
    """Parameters that fit in ``free_bytes`` at ``bytes_per_parameter``, next to the activations
    as measured (the same batch and context: a larger model's activations are larger, so this is
    an upper bound)."""
    if bytes_per_parameter <= 0:
        raise ValueError(f"bytes_per_parameter must be > 0, got {bytes_per_parameter!r}")
    return max(0.0, (free_bytes - activation_bytes) / bytes_per_parameter)


def largest_model_size(parameters: float) -> str | None:
    """The largest of ``MODEL_SIZES`` with at most ``parameters`` parameters (None: none does)."""
    counts = {name: expected_parameter_count(config) for name, config in MODEL_SIZES.items()}
    fitting = [(count, name) for name, count in counts.items() if count <= parameters]
    return max(fitting)[1] if fitting else None


def model_parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters (``parameters()`` yields a shared one once)."""
    return sum(parameter_bytes(p) for p in module.parameters())
