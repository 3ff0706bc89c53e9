"""The forward pass under mixed FSDP (X) and tensor parallelism (Y): compute time, communication time, batch bounds.

The sharding is the Scaling Book's mixed one (Austin et al. 2025, Part 5, "Mixed FSDP and Tensor
Parallelism"): In[B_X, D_Y] ·_D W_in[D_X, F_Y] ·_F W_out[F_Y, D_X] -> Out[B_X, D_Y]. Per block the
forward pass runs, on every device,

1. AllGather over Y of In[B_X, D_Y] into In[B_X, D] (tensor parallel, on the critical path);
2. AllGather over X of W_in[D_X, F_Y] into W_in[D, F_Y] (FSDP, can be prefetched);
3. Tmp[B_X, F_Y] = In[B_X, D] · W_in[D, F_Y];
4. AllGather over X of W_out[F_Y, D_X] into W_out[F_Y, D] (FSDP);
5. Out[B_X, D] (partial sums over Y) = Tmp[B_X, F_Y] · W_out[F_Y, D];
6. ReduceScatter over Y into Out[B_X, D_Y] (tensor parallel, on the critical path).

Cost of one collective. An AllGather over n devices on a bidirectional ring whose result holds V
bytes: every device must receive the (n − 1)/n · V bytes it lacks, through its two ring links, each
carrying W/2 one way, so it takes (n − 1)/n · V/W; a ReduceScatter whose input holds V bytes is its
mirror image and costs the same. Like the Scaling Book we drop (n − 1)/n (exact for large n) and
divide by M when the collective runs along M physical axes at once: T = V / (W·M).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cs336_systems.capacity.shapes import Chip, FeedForwardStack, Mesh, MixedPrecision


def forward_flops(model: FeedForwardStack, tokens: float) -> float:
    """4·B·D·F·L: each block's two matmuls are B×D by D×F and B×F by F×D, 2·B·D·F FLOPs each
    (a multiply and an add per term)."""
    return 4 * tokens * model.d_model * model.d_ff * model.num_blocks


def math_time(model: FeedForwardStack, chip: Chip, mesh: Mesh, tokens: float) -> float:
    """T_math = 4·B·D·F·L / (N·C): the matmuls split evenly over all N = X·Y devices (each computes
    a B/X by F/Y block of Tmp and a B/X by D block of partial Out from an F/Y slice)."""
    c, _ = chip.rates()
    return forward_flops(model, tokens) / (mesh.devices * c)


def fsdp_comm_time(model: FeedForwardStack, chip: Chip, mesh: Mesh, precision: MixedPrecision) -> float:
    """T_FSDP = 2·L · (D·F/Y)·c_w / (W·M_X): steps 2 and 4 of every block.

    Each all-gather over X builds one weight matrix's F/Y slice, D·F/Y elements of c_w bytes. It
    does not depend on the batch: FSDP moves weights.
    """
    _, w = chip.rates()
    gathered = model.d_model * model.d_ff / mesh.tensor * precision.weight_comm_bytes
    return 2 * model.num_blocks * gathered / (w * mesh.fsdp_axes)


def tp_comm_time(model: FeedForwardStack, chip: Chip, mesh: Mesh, precision: MixedPrecision,
                 tokens: float) -> float:
    """T_TP = 2·L · (B/X)·D·c_a / (W·M_Y): steps 1 and 6 of every block.

    The all-gather's result and the reduce-scatter's input are both In/Out[B_X, D]: B/X·D
    activations of c_a bytes. It grows with the batch: tensor parallelism moves activations.
    """
    _, w = chip.rates()
    activations = tokens / mesh.fsdp * model.d_model * precision.activation_comm_bytes
    return 2 * model.num_blocks * activations / (w * mesh.tensor_axes)


@dataclass(frozen=True)
class ForwardTimes:
    """The three times of one forward pass, in seconds."""

    math_s: float
    fsdp_s: float
    tp_s: float

    def comm_s(self, overlap_collectives: bool = False) -> float:
        """Communication the compute must hide: T_FSDP + T_TP when the two kinds of collectives run
        one after the other (the Scaling Book's condition), max(T_FSDP, T_TP) when they run at the
        same time on their disjoint links (X's and Y's)."""
        return max(self.fsdp_s, self.tp_s) if overlap_collectives else self.fsdp_s + self.tp_s

    def compute_bound(self, overlap_collectives: bool = False) -> bool:
        """T_math >= T_comm: communication overlapped with the matmuls costs nothing extra."""
        return self.math_s >= self.comm_s(overlap_collectives)


def forward_times(model: FeedForwardStack, chip: Chip, mesh: Mesh, precision: MixedPrecision,
                  tokens: float) -> ForwardTimes:
    return ForwardTimes(math_time(model, chip, mesh, tokens), fsdp_comm_time(model, chip, mesh, precision),
                        tp_comm_time(model, chip, mesh, precision, tokens))


def min_compute_bound_tokens(model: FeedForwardStack, chip: Chip, mesh: Mesh, precision: MixedPrecision,
                             overlap_collectives: bool = False) -> float | None:
    """The smallest batch B (tokens, real-valued) with T_math >= T_comm, or None if no batch is enough.

    Divide every time by 2·D·L/W. Serial collectives: 2·B·F/(N·α) >= c_w·F/(Y·M_X) + c_a·B/(X·M_Y),
    linear in B, so

        B* = (c_w·F / (Y·M_X)) / (2·F/(N·α) − c_a/(X·M_Y)),

    which exists only while the bracket is positive (tensor parallelism alone must be hideable:
    see :func:`max_tensor_degree`). Overlapped collectives: each must fit on its own; the TP one
    gives the same batch-free condition, the FSDP one B >= c_w·N·α/(2·Y·M_X) = c_w·X·α/(2·M_X),
    which is the Scaling Book's FSDP bound B/X >= α/M_X for BF16 weights.
    """
    alpha = chip.alpha
    n, x, y = mesh.devices, mesh.fsdp, mesh.tensor
    c_w, c_a = precision.weight_comm_bytes, precision.activation_comm_bytes
    spare = 2 * model.d_ff / (n * alpha) - c_a / (x * mesh.tensor_axes)  # math minus TP, per token
    if spare < 0:
        return None
    if overlap_collectives:
        return c_w * x * alpha / (2 * mesh.fsdp_axes)
    if spare == 0:
        return None
    return c_w * model.d_ff / (y * mesh.fsdp_axes) / spare


def smallest_compute_bound_batch(model: FeedForwardStack, chip: Chip, mesh: Mesh, precision: MixedPrecision,
                                 overlap_collectives: bool = False) -> int | None:
    """The smallest whole batch that is compute-bound and splits into whole tokens per FSDP shard:
    B* rounded up to a multiple of X (the batch is sharded over X: In[B_X, D_Y])."""
    bound = min_compute_bound_tokens(model, chip, mesh, precision, overlap_collectives)
    if bound is None:
        return None
    return math.ceil(bound / mesh.fsdp) * mesh.fsdp


def max_tensor_degree(model: FeedForwardStack, chip: Chip, precision: MixedPrecision, tensor_axes: float) -> float:
    """The largest Y for which tensor parallelism alone can be hidden: T_math >= T_TP for any B.

    4·B·D·F·L/(X·Y·C) >= 2·c_a·B·D·L/(X·W·M_Y)  <=>  Y <= 2·F·M_Y/(c_a·α): F·M_Y/α in BF16, the
    Scaling Book's "Y < n_axes·F/2550" (its Tensor Parallelism section). B and X cancel.
    """
    return 2 * model.d_ff * tensor_axes / (precision.activation_comm_bytes * chip.alpha)


def best_split_min_tokens_per_device(model: FeedForwardStack, chip: Chip, precision: MixedPrecision,
                                     fsdp_axes: float, tensor_axes: float) -> float:
    """The least B/N any split of N devices into X·Y can reach with serial collectives.

    With Y = N/X the communication is (2·D·L/W)·(c_w·F·X/(N·M_X) + c_a·B/(X·M_Y)); its minimum over
    X, where the two terms are equal, is (4·D·L/W)·sqrt(c_w·c_a·F·B/(N·M_X·M_Y)). Setting T_math =
    4·B·D·F·L/(N·C) at least that and squaring gives

        B/N >= c_w·c_a·α² / (F·M_X·M_Y),

    which in BF16 is the Scaling Book's 4·α²/(F·M_X·M_Y) (2·2550²/F for M_X = 2, M_Y = 1).
    """
    c_w, c_a = precision.weight_comm_bytes, precision.activation_comm_bytes
    return c_w * c_a * chip.alpha ** 2 / (model.d_ff * fsdp_axes * tensor_axes)


def best_split_fsdp_degree(model: FeedForwardStack, chip: Chip, precision: MixedPrecision, devices: int,
                           tensor_axes: float) -> float:
    """The X at which :func:`best_split_min_tokens_per_device` is reached: c_a·N·α/(F·M_Y)."""
    return precision.activation_comm_bytes * devices * chip.alpha / (model.d_ff * tensor_axes)


def compute_bound_fsdp_range(model: FeedForwardStack, chip: Chip, precision: MixedPrecision, tokens: float,
                             devices: int, fsdp_axes: float, tensor_axes: float) -> tuple[float, float] | None:
    """The X (real-valued, Y = N/X) for which a batch of B tokens is compute-bound with serial collectives.

    Multiplying T_math >= T_FSDP + T_TP by X·N·W·M_X·M_Y/(2·D·L) gives the quadratic

        c_w·F·M_Y·X² − (2·B·F·M_X·M_Y/α)·X + c_a·B·N·M_X <= 0,

    true between its roots (the Scaling Book's quadratic, scaled by α/2, in BF16). None when the
    discriminant is negative: no split hides the communication of this batch.
    """
    alpha = chip.alpha
    c_w, c_a = precision.weight_comm_bytes, precision.activation_comm_bytes
    a = c_w * model.d_ff * tensor_axes
    b = 2 * tokens * model.d_ff * fsdp_axes * tensor_axes / alpha
    c = c_a * tokens * devices * fsdp_axes
    discriminant = b * b - 4 * a * c
    if discriminant < 0:
        return None
    root = math.sqrt(discriminant)
    return (b - root) / (2 * a), (b + root) / (2 * a)


def pipeline_bubble_fraction(stages: int, microbatches: int) -> float:
    """(p − 1)/m: idle time of a 1F1B (or GPipe) pipeline of p stages over m micro-batches, relative to
    the ideal step time (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", Sec. 2.2)."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages and microbatches must be >= 1, got {stages} and {microbatches}")
    return (stages - 1) / microbatches
