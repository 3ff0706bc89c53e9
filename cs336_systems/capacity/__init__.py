"""Capacity planning on paper: memory and forward-pass communication under FSDP and tensor parallelism.

Pure functions of a model's shape (:class:`FeedForwardStack`), its precisions
(:class:`MixedPrecision`), a chip (:class:`Chip`) and a device mesh (:class:`Mesh`); no torch.
``memory`` counts parameters, their FP32 training state and the activations saved for backward,
whole and sharded over N FSDP devices; ``forward`` times the forward pass's matmuls and its FSDP
and tensor-parallel collectives and solves for the smallest batch that keeps them hidden;
``handout`` holds the constants of the handout's problem communication_accounting. The notation is
the TPU Scaling Book's (Austin et al. 2025, Part 5); see ``shapes`` for the vocabulary.

The 2026 edition's section 8 (one FFN layer under DP, FSDP, TP and FSDP + TP) has its own modules,
in the handout's notation: ``strategies`` (the closed forms and bounds), ``ring`` (a step-by-step
simulator of the ring collectives), ``ffn_check`` (FLOPs counted by torch, bytes measured on gloo
ranks, with torch) and ``ffn_bytes`` (the measurement's record and runner).
"""

from cs336_systems.capacity.forward import (
    ForwardTimes,
    best_split_fsdp_degree,
    best_split_min_tokens_per_device,
    compute_bound_fsdp_range,
    forward_flops,
    forward_times,
    fsdp_comm_time,
    math_time,
    max_tensor_degree,
    min_compute_bound_tokens,
    pipeline_bubble_fraction,
    smallest_compute_bound_batch,
    tp_comm_time,
)
from cs336_systems.capacity.memory import (
    devices_worth,
    fsdp_bytes_per_device,
    gathered_block_bytes,
    max_tokens_for_any_fsdp,
    min_fsdp_devices,
    parameter_count,
    saved_activation_bytes,
    saved_activation_bytes_per_token,
    state_bytes_per_parameter,
    training_state_bytes,
)
from cs336_systems.capacity.shapes import (
    BF16_BYTES,
    FP8_BYTES,
    FP32_BYTES,
    Chip,
    FeedForwardStack,
    Mesh,
    MixedPrecision,
)
