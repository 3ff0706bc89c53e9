"""Memory of a feed-forward stack in training: parameters, their FP32 state, activations saved for backward.

Each function states the count it makes; nothing here allocates anything. Tokens are counted as in
the Scaling Book: B is the number of tokens in a batch (sequences times their length).
"""

from __future__ import annotations

import math

from cs336_systems.capacity.shapes import Chip, FeedForwardStack, MixedPrecision


def parameter_count(model: FeedForwardStack) -> int:
    """P = L · 2·D·F.

    Each block has W_in of D×F and W_out of F×D entries and no biases, so 2·D·F parameters, and
    there are L blocks.
    """
    return model.num_blocks * 2 * model.d_model * model.d_ff


def state_bytes_per_parameter(precision: MixedPrecision) -> int:
    """Bytes of training state per parameter: master weight + accumulated gradient + optimizer moments.

    With the handout's FP32 for all three and Adam's two moments: 4 + 4 + 2·4 = 16 bytes. The
    BF16 working copy of the weights used by the matmuls is not part of this count: under FSDP it
    exists only for the layer being computed (see :func:`gathered_block_bytes`).
    """
    p = precision
    return p.master_weight_bytes + p.gradient_bytes + p.optimizer_moments * p.optimizer_moment_bytes


def training_state_bytes(model: FeedForwardStack, precision: MixedPrecision) -> int:
    """S = P · (bytes of state per parameter)."""
    return parameter_count(model) * state_bytes_per_parameter(precision)


def saved_activation_bytes_per_token(model: FeedForwardStack, precision: MixedPrecision) -> int:
    """a = L · (D + F) · (activation bytes): what one token leaves saved for backward.

    The weight gradient of a linear layer y = x·W is xᵀ·dy, so backward needs each layer's input x:
    the block's input (D values) for W_in and the first layer's output, which is the second
    layer's input because there is no activation function between them (F values), for W_out.
    Nothing else is saved: without an activation function, no pre-activation is needed, and the
    gradients with respect to the inputs need only the weights.
    """
    return model.num_blocks * (model.d_model + model.d_ff) * precision.activation_bytes


def saved_activation_bytes(model: FeedForwardStack, precision: MixedPrecision, tokens: float) -> float:
    """A(B) = a · B for a batch of B tokens (no activation checkpointing, as the handout asks)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    return saved_activation_bytes_per_token(model, precision) * tokens


def devices_worth(n_bytes: float, chip: Chip) -> float:
    """How many of ``chip``'s memories ``n_bytes`` fills: n_bytes / HBM (round up for a device count)."""
    return n_bytes / chip.hbm_bytes


def fsdp_bytes_per_device(model: FeedForwardStack, precision: MixedPrecision, n_fsdp: int, tokens: float,
                          sharded_activations: float = 0.5) -> float:
    """M(N) = (S + f·A)/N + (1 − f)·A on each of N FSDP devices.

    S (weights, gradients, optimizer state) is split evenly over the N devices, as ZeRO stage 3
    does (Rajbhandari et al. 2020). Of the activations A saved for the ``tokens`` counted, a
    fraction f is sharded over the same N devices and the rest is held whole on each; the handout
    takes f = 1/2 ("in practice every second layer").
    """
    if n_fsdp < 1:
        raise ValueError(f"n_fsdp must be >= 1, got {n_fsdp}")
    if not 0 <= sharded_activations <= 1:
        raise ValueError(f"sharded_activations must be in [0, 1], got {sharded_activations}")
    a = saved_activation_bytes(model, precision, tokens)
    return (training_state_bytes(model, precision) + sharded_activations * a) / n_fsdp \
        + (1 - sharded_activations) * a


def min_fsdp_devices(model: FeedForwardStack, precision: MixedPrecision, chip: Chip, tokens: float,
                     sharded_activations: float = 0.5) -> int | None:
    """The smallest N with M(N) < HBM, or None when no N is enough.

    M(N) < H  <=>  N > (S + f·A) / (H − (1 − f)·A), which needs H > (1 − f)·A: the unsharded part
    of the activations is on every device whatever N is. The smallest integer above the bound is
    floor(bound) + 1.
    """
    a = saved_activation_bytes(model, precision, tokens)
    room = chip.hbm_bytes - (1 - sharded_activations) * a
    if room <= 0:
        return None
    bound = (training_state_bytes(model, precision) + sharded_activations * a) / room
    return math.floor(bound) + 1


def max_tokens_for_any_fsdp(model: FeedForwardStack, precision: MixedPrecision, chip: Chip,
                            sharded_activations: float = 0.5) -> float:
    """The token count at which the unsharded activations alone fill a device: H / ((1 − f)·a).

    Beyond it no number of FSDP devices fits (:func:`min_fsdp_devices` returns None).
    """
    if sharded_activations >= 1:
        return math.inf
    return chip.hbm_bytes / ((1 - sharded_activations) * saved_activation_bytes_per_token(model, precision))


def gathered_block_bytes(model: FeedForwardStack, precision: MixedPrecision, tensor: int = 1) -> float:
    """2·D·F/Y weights of one block in the all-gather precision: FSDP's transient full copy of a block.

    Not part of the handout's count; one or two such buffers (the block computed and the one
    prefetched) come on top of M(N).
    """
    return 2 * model.d_model * model.d_ff * precision.weight_comm_bytes / tensor
