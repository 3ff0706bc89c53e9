"""The inputs of the handout's problem communication_accounting, defined once, and the variants part (d) weighs.

CS336 spring 2025, assignment 2, section 2.4: the XXL model (d_model = 16384, d_ff = 53248,
num_blocks = 126), H100 80GB and TPU v5p (95GB) memories, and for TPU v5p the Scaling Book's
C = 4.6·10^14 FLOP/s and W_ici = 2·9·10^10 bytes/s, on a mesh of X = 16 (FSDP) by Y = 4 (tensor
parallel) with M_X = 2 and M_Y = 1.

Memory sizes are read in the repo's unit, GB = 2^30 bytes (:mod:`cs336_systems.units`), which is
also how the vendors count HBM (Google lists v5p's HBM as 95 GiB per chip); ``DECIMAL_GB`` gives
the other reading, 10^9 bytes, for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cs336_systems.capacity.shapes import FP8_BYTES, Chip, FeedForwardStack, Mesh, MixedPrecision
from cs336_systems.units import GB

DECIMAL_GB = 10**9

XXL = FeedForwardStack(d_model=16384, d_ff=53248, num_blocks=126)
HANDOUT_PRECISION = MixedPrecision()  # FP32 master weights, gradients, Adam state; BF16 activations and comms
H100_MEMORY_GB, V5P_MEMORY_GB = 80, 95
H100 = Chip("H100 80GB", H100_MEMORY_GB * GB)
TPU_V5P = Chip("TPU v5p", V5P_MEMORY_GB * GB, flops_per_s=4.6e14, ici_bytes_per_s=2 * 9e10)
XXL_MESH = Mesh(fsdp=16, tensor=4, fsdp_axes=2, tensor_axes=1)
SHARDED_ACTIVATIONS = 0.5  # "half of your activations (in practice every second layer) are sharded"


def decimal_reading(chip: Chip, memory_gb: int) -> Chip:
    """``chip`` with its memory read as ``memory_gb`` · 10^9 bytes."""
    return replace(chip, hbm_bytes=memory_gb * DECIMAL_GB)


@dataclass(frozen=True)
class Variant:
    """One way of running the forward pass of part (c) differently, for part (d)."""

    key: str  # a short identifier for prose that cites the variant
    name: str  # what changes, in words
    change: str  # what changes in (c)'s equations (markdown with LaTeX)
    mesh: Mesh  # the mesh one pipeline stage runs on
    precision: MixedPrecision = HANDOUT_PRECISION
    overlap_collectives: bool = False
    pipeline_stages: int = 1

    @property
    def devices(self) -> int:
        """All devices: one stage's mesh times the stages."""
        return self.mesh.devices * self.pipeline_stages


X, Y, M_X, M_Y = XXL_MESH.fsdp, XXL_MESH.tensor, XXL_MESH.fsdp_axes, XXL_MESH.tensor_axes
STAGES = 4  # the pipeline variant's stages, on the same devices
VARIANTS: tuple[Variant, ...] = (
    Variant("as_given", "as given: collectives one after the other", "none (part (c))", XXL_MESH),
    Variant("overlapped", "FSDP and TP collectives at the same time, each on its own axis's links",
            r"$T_{\mathrm{comm}} = \max(T_{\mathrm{FSDP}}, T_{\mathrm{TP}})$", XXL_MESH, overlap_collectives=True),
    Variant("more_tp", f"more tensor parallelism: X = {X // 2}, Y = {Y * 2}",
            r"$T_{\mathrm{FSDP}}$ halves, $T_{\mathrm{TP}}$ doubles", Mesh(X // 2, Y * 2, M_X, M_Y)),
    Variant("most_tp", f"more still: X = {X // 4}, Y = {Y * 4}",
            r"$T_{\mathrm{FSDP}} \div 4$, $T_{\mathrm{TP}} \times 4$", Mesh(X // 4, Y * 4, M_X, M_Y)),
    Variant("fp8_weights", "FSDP weight all-gathers in 8 bits", r"$c_w = 1$: $T_{\mathrm{FSDP}}$ halves", XXL_MESH,
            precision=replace(HANDOUT_PRECISION, weight_comm_bytes=FP8_BYTES)),
    Variant("fp8_both", "both collectives in 8 bits", r"$c_w = c_a = 1$: both halve", XXL_MESH,
            precision=replace(HANDOUT_PRECISION, weight_comm_bytes=FP8_BYTES, activation_comm_bytes=FP8_BYTES)),
    Variant("more_links", "FSDP collectives over one more axis's links (hypothetical)",
            f"$M_X = {M_X + 1}$: $T_{{\\mathrm{{FSDP}}}} \\times {M_X}/{M_X + 1}$", Mesh(X, Y, M_X + 1, M_Y)),
    Variant("pipeline", f"{STAGES} pipeline stages, each X = {X // STAGES}, Y = {Y} (same {XXL_MESH.devices} devices)",
            f"a stage runs about $L/{STAGES}$ blocks on $N/{STAGES}$ devices", Mesh(X // STAGES, Y, M_X, M_Y),
            pipeline_stages=STAGES),
)
VARIANT = {v.key: v for v in VARIANTS}
