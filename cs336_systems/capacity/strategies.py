"""The 2026 handout's section 8: one FFN layer under DP, FSDP, TP and FSDP + TP, on paper.

The layer is equations (20)–(23): x[B, D] -> x1 = x W1, x2 = x W2 (W1, W2: [D, D_FF]),
z = f(x1) * x2, y = z W3 (W3: [D_FF, D]); everything in FP16 (2 bytes). A device computes at C
FLOP/s and sends at W bytes/s; collectives are the ring ones of section 8.1 (see :mod:`.ring`):
an all-gather or a reduce-scatter of a tensor of S bytes over n devices takes (n − 1)/n · S/W,
an all-reduce twice that. Only matmuls count, 2·a·b·c FLOPs for [a, b]·[b, c].

Every function returns what one device does (FLOPs) or waits (seconds), per the handout's
deliverables; :mod:`.ffn_check` counts the FLOPs with torch and measures the bytes on gloo ranks.
The bounds are where computation time equals communication time, solved exactly (the (n − 1)/n
factors kept), so each holds with equality at its value.
"""

from __future__ import annotations

from dataclasses import dataclass

from cs336_systems.capacity.shapes import BF16_BYTES

ELEMENT_BYTES = BF16_BYTES  # the handout's FP16: two bytes, like BF16
FORWARD_MATMULS, BACKWARD_MATMULS = 3, 6  # (20), (21), (23); (24), two in (27), (28)–(30)


@dataclass(frozen=True)
class Ffn:
    """The layer's shape: B tokens (rows of x), D = d_model, D_FF."""

    batch: float  # B
    d_model: float  # D
    d_ff: float  # D_FF

    def matmul_flops(self) -> float:
        """2·B·D·D_FF: one of the layer's matmuls over the whole batch, unsharded."""
        return 2 * self.batch * self.d_model * self.d_ff

    @property
    def weight_bytes(self) -> float:
        """All three weights: 3·D·D_FF elements of 2 bytes."""
        return 3 * self.d_model * self.d_ff * ELEMENT_BYTES

    @property
    def activation_bytes(self) -> float:
        """One [B, D] activation (y or dx) in FP16."""
        return self.batch * self.d_model * ELEMENT_BYTES


def ring_gather_s(size_bytes: float, n: float, w: float) -> float:
    """A ring all-gather (or reduce-scatter) of ``size_bytes`` over n devices: (n − 1)/n · S/W."""
    return (n - 1) / n * size_bytes / w


def ring_all_reduce_s(size_bytes: float, n: float, w: float) -> float:
    """A ring all-reduce: 2 (n − 1)/n · S/W."""
    return 2 * ring_gather_s(size_bytes, n, w)


def alternate_all_reduce_s(size_bytes: float, n: float, w: float) -> float:
    """alternate_ring_all_reduce: N − 1 steps, each sending a whole tensor: (N − 1) · S/W."""
    return (n - 1) * size_bytes / w


# FLOPs per device. DP, FSDP and TP split every matmul N ways (the batch, or D_FF); 2D splits the
# batch over N_FSDP and D_FF over N_TP.
def forward_flops(ffn: Ffn, devices: float) -> float:
    """6·B·D·D_FF / N: three matmuls, each over a 1/N share of the batch (DP, FSDP) or of D_FF (TP);
    2D: N = N_FSDP·N_TP."""
    return FORWARD_MATMULS * ffn.matmul_flops() / devices


def backward_flops(ffn: Ffn, devices: float) -> float:
    """12·B·D·D_FF / N: dz, the two products of dx, and dW1, dW2, dW3 (equations (24)–(30))."""
    return BACKWARD_MATMULS * ffn.matmul_flops() / devices


# Communication time per device, seconds.
def dp_backward_comm_s(ffn: Ffn, n: float, w: float) -> float:
    """All-reduce of dW1, dW2, dW3: 2 (N − 1)/N · 6·D·D_FF / W."""
    return ring_all_reduce_s(ffn.weight_bytes, n, w)


def fsdp_forward_comm_s(ffn: Ffn, n: float, w: float) -> float:
    """All-gather of W1, W2, W3 (34)–(36): (N − 1)/N · 6·D·D_FF / W."""
    return ring_gather_s(ffn.weight_bytes, n, w)


def fsdp_backward_comm_s(ffn: Ffn, n: float, w: float) -> float:
    """All-gather again (38)–(40), then reduce-scatter the gradients (42)–(44): twice the forward's."""
    return 2 * ring_gather_s(ffn.weight_bytes, n, w)


def tp_comm_s(ffn: Ffn, n: float, w: float) -> float:
    """Forward: all-reduce of y (51); backward: all-reduce of dx. Each 2 (N − 1)/N · 2·B·D / W."""
    return ring_all_reduce_s(ffn.activation_bytes, n, w)


def fsdp_tp_forward_comm_s(ffn: Ffn, n_fsdp: float, n_tp: float, w: float) -> tuple[float, float]:
    """(FSDP axis, TP axis) of the 2D forward pass. FSDP: all-gather each weight's TP shard,
    6·D·D_FF/N_TP bytes in all, over N_FSDP (52)–(54). TP: all-reduce y^(i,j), [B/N_FSDP, D], over N_TP (59)."""
    fsdp = ring_gather_s(ffn.weight_bytes / n_tp, n_fsdp, w)
    tp = ring_all_reduce_s(ffn.activation_bytes / n_fsdp, n_tp, w)
    return fsdp, tp


# The largest N with computation time >= communication time, from the equations above.
def dp_max_devices(ffn: Ffn, c: float, w: float) -> float:
    """12BDF/(NC) >= 12(N − 1)DF/(NW)  <=>  N <= 1 + B·W/C. FSDP's forward and backward give the same."""
    return 1 + ffn.batch * w / c


def tp_max_devices_backward(ffn: Ffn, c: float, w: float) -> float:
    """12BDF/(NC) >= 4(N − 1)BD/(NW)  <=>  N <= 1 + 3·D_FF·W/C."""
    return 1 + 3 * ffn.d_ff * w / c


def tp_max_devices_forward(ffn: Ffn, c: float, w: float) -> float:
    """6BDF/(NC) >= 4(N − 1)BD/(NW)  <=>  N <= 1 + 3·D_FF·W/(2C)."""
    return 1 + 3 * ffn.d_ff * w / (2 * c)


def fsdp_tp_max_devices_overlapped(ffn: Ffn, c: float, w: float) -> tuple[float, float, float]:
    """(N, N_FSDP, N_TP) with max(T_FSDP, T_TP) <= T_comp: the two conditions separate,
    N_FSDP <= 1 + B·W/C and N_TP <= 1 + 3·D_FF·W/(2C), so N is at most their product."""
    n_fsdp, n_tp = dp_max_devices(ffn, c, w), tp_max_devices_forward(ffn, c, w)
    return n_fsdp * n_tp, n_fsdp, n_tp


def fsdp_tp_max_devices_serial(ffn: Ffn, c: float, w: float) -> tuple[float, float, float]:
    """(N, N_FSDP, N_TP) with T_FSDP + T_TP <= T_comp, at the best split.

    Times N·W/(2D): 3·D_FF·(N_FSDP − 1) + 2B·(N_TP − 1) <= 3·B·D_FF·W/C =: R. The product
    N_FSDP·N_TP on that line is largest where both terms are equal, (R + 3D_FF + 2B)/2 each:
    N <= (R + 3·D_FF + 2B)² / (24·B·D_FF), about a quarter of the overlapped bound when R dominates.
    """
    r = 3 * ffn.batch * ffn.d_ff * w / c
    half = (r + 3 * ffn.d_ff + 2 * ffn.batch) / 2
    n_fsdp, n_tp = half / (3 * ffn.d_ff), half / (2 * ffn.batch)
    return n_fsdp * n_tp, n_fsdp, n_tp


@dataclass(frozen=True)
class Accelerator:
    """A realistic C and W for the bounds: a vendor's dense FP16/BF16 matmul rate and one-way
    NVLink bandwidth per GPU (the handout's egress W)."""

    name: str
    flops_per_s: float  # C
    egress_bytes_per_s: float  # W
    source: str  # where the two figures come from


# NVIDIA's data sheets: H100 SXM 989 TFLOP/s dense BF16 (1,979 with sparsity), NVLink 4 900 GB/s
# in both directions together; B200 (HGX) 2.25 PFLOP/s dense BF16, NVLink 5 1.8 TB/s together.
H100_SXM = Accelerator("H100 SXM", 989e12, 450e9, "NVIDIA H100 data sheet: 989 TFLOP/s dense BF16, NVLink 900 GB/s both ways")
B200 = Accelerator("B200", 2.25e15, 900e9, "NVIDIA HGX B200 data sheet: 2.25 PFLOP/s dense BF16, NVLink 1.8 TB/s both ways")
ACCELERATORS = (H100_SXM, B200)
# The handout's leaderboard model (section 9): d_model 4096, d_ff 11008, 2 sequences of 32,768 tokens.
LEADERBOARD_FFN = Ffn(batch=2 * 32768, d_model=4096, d_ff=11008)
