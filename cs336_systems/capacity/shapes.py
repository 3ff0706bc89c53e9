"""The typed inputs of every capacity formula: the model's shape, its precisions, a chip and a device mesh.

Vocabulary (the TPU Scaling Book's, Austin et al. 2025, Part 5 "How to Parallelize a Transformer
for Training"): D = d_model, F = d_ff, L = number of blocks, B = tokens in the batch, X = devices
along the FSDP axis, Y = devices along the tensor-parallel axis, N = X·Y, M_X and M_Y = the number of
physical mesh axes whose links X and Y use, C = peak FLOP/s of one chip, W = bidirectional bandwidth
of one chip along one mesh axis (bytes/s), α = C/W (FLOPs per byte moved: the network's
arithmetic intensity).
"""

from __future__ import annotations

from dataclasses import dataclass

BF16_BYTES = 2
FP32_BYTES = 4
FP8_BYTES = 1


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class FeedForwardStack:
    """A model of L blocks, each two bias-free linear layers D -> F -> D with nothing in between.

    The handout's simplification of a large Transformer: attention, embeddings, the output layer
    and the activation function are left out, since the feed-forward matmuls hold most FLOPs.
    """

    d_model: int  # D: input of the first layer, output of the second
    d_ff: int  # F: output of the first layer, input of the second
    num_blocks: int  # L

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff", "num_blocks"):
            _positive(name, getattr(self, name))


@dataclass(frozen=True)
class MixedPrecision:
    """Bytes per element of everything the accounting counts (defaults: the handout's choices).

    The handout puts master weights, accumulated gradients and optimizer state in FP32 and
    activations and gradient communication in BF16. Adam keeps two moments (first and second) per
    parameter. The forward pass's weight all-gathers move the weights in BF16, as the Scaling
    Book's FSDP analysis does (its weights are ``bf16[D, F]``).
    """

    master_weight_bytes: int = FP32_BYTES
    gradient_bytes: int = FP32_BYTES  # accumulated gradients
    optimizer_moments: int = 2  # Adam: m and v
    optimizer_moment_bytes: int = FP32_BYTES
    activation_bytes: int = BF16_BYTES  # what is saved for backward
    weight_comm_bytes: int = BF16_BYTES  # FSDP all-gathers of weights
    activation_comm_bytes: int = BF16_BYTES  # tensor-parallel all-gathers and reduce-scatters

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if name != "optimizer_moments":
                _positive(name, value)
        if self.optimizer_moments < 0:
            raise ValueError(f"optimizer_moments must be >= 0, got {self.optimizer_moments}")


@dataclass(frozen=True)
class Chip:
    """One accelerator: its memory and, where known, its matmul throughput and per-axis link bandwidth."""

    name: str
    hbm_bytes: float  # memory of one device
    flops_per_s: float | None = None  # C: peak BF16 matmul FLOP/s
    ici_bytes_per_s: float | None = None  # W: bidirectional bandwidth along one mesh axis

    def __post_init__(self) -> None:
        _positive("hbm_bytes", self.hbm_bytes)
        for name in ("flops_per_s", "ici_bytes_per_s"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))

    def rates(self) -> tuple[float, float]:
        """(C, W); a chip given by its memory alone cannot time anything."""
        if self.flops_per_s is None or self.ici_bytes_per_s is None:
            raise ValueError(f"{self.name} has no FLOP/s or link bandwidth: give both to time a step on it")
        return self.flops_per_s, self.ici_bytes_per_s

    @property
    def alpha(self) -> float:
        """α = C/W: FLOPs a chip does in the time it moves one byte over one mesh axis."""
        c, w = self.rates()
        return c / w


@dataclass(frozen=True)
class Mesh:
    """A 2D logical mesh of X (FSDP) by Y (tensor parallel) devices laid over physical mesh axes.

    Degrees are whole numbers on real hardware; the analysis also accepts real values (to find the
    best split of N devices, for instance).
    """

    fsdp: int  # X: the batch and the weights' D (of W_in) are sharded over it
    tensor: int  # Y: the activations' D and the weights' F are sharded over it
    fsdp_axes: float = 1  # M_X: physical axes whose links the X collectives use at once
    tensor_axes: float = 1  # M_Y

    def __post_init__(self) -> None:
        for name in ("fsdp", "tensor", "fsdp_axes", "tensor_axes"):
            _positive(name, getattr(self, name))

    @property
    def devices(self) -> int:
        """N = X·Y."""
        return self.fsdp * self.tensor
