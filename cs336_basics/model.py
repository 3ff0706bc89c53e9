"""The first assignment's building blocks and the Transformer LM built from them.

Blocks: :class:`Linear` (bias-free), :class:`Embedding` and :class:`RMSNorm`, with the
initialisations CS336 assignment 1 prescribes. The FSDP wrapper shards the weights of
``Linear`` and ``Embedding``; everything else is replicated.

The LM is the workload of every benchmark. Architecture (the one the CS336 assignments
build), from input to output: (the one the CS336 assignments build), from input to output:

* token embedding (vocab_size x d_model), no absolute position embedding;
* ``num_layers`` pre-norm blocks, each ``x + attn(norm(x))`` then ``x + ffn(norm(x))``
  (pre-norm: Xiong et al., 2020, "On Layer Normalization in the Transformer Architecture");
  * RMSNorm (Zhang & Sennrich, 2019) with a learnable gain, eps 1e-5;
  * causal multi-head self-attention; positions enter as rotary embeddings applied to
    queries and keys (RoPE: Su et al., 2021, "RoFormer");
  * SwiGLU feed-forward ``w2(silu(w1 x) * w3 x)`` (Shazeer, 2020, "GLU Variants Improve
    Transformer");
* a final RMSNorm and an untied LM head (d_model -> vocab_size).

No linear layer has a bias. Sizes: ``MODEL_SIZES`` holds the model-size table of the CS336
(Spring 2025) assignment 2 handout's benchmarking section (small, medium, large, xl, 2.7B, with
the handout's vocabulary of 10,000 and d_ff = 4 d_model), plus two sizes of our own that fit a
CPU. This module knows nothing of distribution; the DDP and FSDP wrappers take any
``nn.Module``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TransformerConfig:
    """Shape of a :class:`TransformerLM`."""

    context_length: int  # longest sequence the model accepts (RoPE tables are built for it)
    d_model: int  # width of the residual stream
    d_ff: int  # inner width of the SwiGLU feed-forward
    num_layers: int  # Transformer blocks
    num_heads: int  # attention heads; each has d_model // num_heads dimensions
    vocab_size: int = 10_000  # tokens; the handout's benchmark vocabulary
    rope_theta: float = 10_000.0  # RoPE base: pair k rotates by position / theta**(2k / head_dim)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "rope_theta":
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{f.name} must be a positive int, got {value!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head dimension d_model // num_heads = {self.d_model} // {self.num_heads} = "
                f"{self.head_dim} must be even: RoPE rotates pairs of dimensions"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


def _size(
    d_model: int, d_ff: int, num_layers: int, num_heads: int, context_length: int = 256
) -> TransformerConfig:
    return TransformerConfig(
        context_length=context_length,
        d_model=d_model,
        d_ff=d_ff,
        num_layers=num_layers,
        num_heads=num_heads,
    )


MODEL_SIZES: dict[str, TransformerConfig] = {
    # Ours: tests and quick runs; builds and trains a step in milliseconds on a CPU.
    "tiny": _size(64, 128, 2, 4, context_length=32),
    # Ours: the CPU benchmarks' workload (22.7M parameters). d_ff is about 8/3 d_model rounded to
    # a multiple of 64, the SwiGLU sizing of CS336 assignment 1, which keeps the feed-forward's
    # parameter count near that of a 4 d_model two-matrix MLP.
    "cpu-small": _size(512, 1344, 4, 16),
    # The handout's table (d_model, d_ff, num_layers, num_heads); context 256 by default.
    "small": _size(768, 3072, 12, 12),
    "medium": _size(1024, 4096, 24, 16),
    "large": _size(1280, 5120, 36, 20),
    "xl": _size(1600, 6400, 48, 25),
    "2.7B": _size(2560, 10240, 32, 32),
}

# The 2026 handout's Table 1, where it differs from the 2025 one above (small, medium and large
# are the same): its xl is the 2025 table's 2.7B shape (about 3.41B parameters with the 10,000-token
# vocabulary), and it adds a 10B. MODEL_SIZES keeps the 2025 names, which the results files record.
MODEL_SIZES_2026: dict[str, TransformerConfig] = {
    "xl": _size(2560, 10240, 32, 32),
    "10B": _size(4608, 12288, 50, 36),
}
# Each edition's model sizes by the handout's names.
EDITION_MODEL_SIZES: dict[str, dict[str, TransformerConfig]] = {
    "2025": MODEL_SIZES,
    "2026": {**MODEL_SIZES, **MODEL_SIZES_2026},
}


def model_config(name: str, context_length: int | None = None) -> TransformerConfig:
    """The config of size ``name`` from :data:`MODEL_SIZES`, with ``context_length`` if given."""
    if name not in MODEL_SIZES:
        raise ValueError(f"unknown model size {name!r}; known sizes: {', '.join(MODEL_SIZES)}")
    config = MODEL_SIZES[name]
    if context_length is not None:
        config = replace(config, context_length=context_length)  # re-runs the validation
    return config


def expected_parameter_count(config: TransformerConfig) -> int:
    """Parameters of ``TransformerLM(config)`` by formula, independent of the module code.

    Embedding V*d; per layer 4 d^2 (q, k, v, output projections) + 3 d d_ff (w1, w2, w3)
    + 2 d (two norm gains); final norm d; LM head d*V (untied, so counted again).
    """
    d, v = config.d_model, config.vocab_size
    per_layer = 4 * d * d + 3 * d * config.d_ff + 2 * d
    return v * d + config.num_layers * per_layer + d + d * v


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters of ``model``, a tensor shared by several layers counted once."""
    # Module.parameters() yields each Parameter object once, however many modules hold it.
    return sum(p.numel() for p in model.parameters())


def _truncated_normal(rows: int, cols: int, std: float, device=None, dtype=None) -> nn.Parameter:
    """A (rows, cols) parameter drawn from N(0, std^2) truncated at 3 std."""
    weight = torch.empty(rows, cols, device=device, dtype=dtype)
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
    return nn.Parameter(weight)


class Linear(nn.Module):
    """``y = x W^T`` with ``W`` of shape (d_out, d_in) and no bias.

    Initialised N(0, 2 / (d_in + d_out)) truncated at 3 sigma, as CS336 assignment 1
    prescribes: the variance of activations and of gradients stays about constant through the
    layer (Glorot & Bengio, 2010, with fan-in and fan-out averaged).
    """

    def __init__(self, d_in: int, d_out: int, device=None, dtype=None):
        super().__init__()
        self.weight = _truncated_normal(d_out, d_in, math.sqrt(2.0 / (d_in + d_out)), device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        d_out, d_in = self.weight.shape
        return f"d_in={d_in}, d_out={d_out}"


class Embedding(nn.Module):
    """Row ``i`` of ``weight`` (num_embeddings x embedding_dim) for token id ``i``.

    Initialised N(0, 1) truncated at 3, as CS336 assignment 1 prescribes; the first RMSNorm
    rescales the rows, so their scale does not reach the attention logits.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = _truncated_normal(num_embeddings, embedding_dim, 1.0, device, dtype)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)

    def extra_repr(self) -> str:
        num_embeddings, embedding_dim = self.weight.shape
        return f"num_embeddings={num_embeddings}, embedding_dim={embedding_dim}"


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * gain`` over the last dimension, computed in float32.

    Squaring low-precision activations can overflow (fp16) or lose the mean (bf16), so the
    statistics are taken in float32 and the result cast back to the input dtype.
    """

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.gain = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * inv_rms * self.gain.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"d_model={self.gain.shape[0]}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """Rotary position embedding over ``head_dim``-sized vectors, for positions < context_length.

    Dimensions (2k, 2k+1) of the vector at position i are rotated by the angle
    i / theta**(2k / head_dim) (RoFormer, Eq. 34). A rotation by i*w applied to a query and by
    j*w to a key leaves their dot product a function of i - j only, which is how attention
    sees relative positions. The cos and sin tables are buffers (they follow ``.to(device)``)
    but not persistent: they are recomputed from the config, so checkpoints do not carry them.
    """

    def __init__(self, head_dim: int, context_length: int, theta: float):
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)  # [context, head_dim/2]
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape [..., seq, head_dim]; position p is row p of the sequence."""
        seq_len = x.shape[-2]
        cos = self.cos[:seq_len].to(x.dtype)
        sin = self.sin[:seq_len].to(x.dtype)
        even, odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return rotated.flatten(-2)  # interleave the pairs back into place


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position i attends to positions <= i."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.q_proj = Linear(config.d_model, config.d_model)
        self.k_proj = Linear(config.d_model, config.d_model)
        self.v_proj = Linear(config.d_model, config.d_model)
        self.output_proj = Linear(config.d_model, config.d_model)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q = rotary(self._split_heads(self.q_proj(x)))
        k = rotary(self._split_heads(self.k_proj(x)))
        v = self._split_heads(self.v_proj(x))
        # is_causal=True masks keys after the query's position (softmax weight exactly 0).
        heads = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(heads.transpose(1, 2).reshape(batch, seq, d_model))


class SwiGLU(nn.Module):
    """Gated feed-forward ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w3 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: attention then feed-forward, each added to the residual stream."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ffn_norm = RMSNorm(config.d_model)
        self.ffn = SwiGLU(config.d_model, config.d_ff)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rotary)
        return x + self.ffn(self.ffn_norm(x))


class TransformerLM(nn.Module):
    """Decoder-only LM: token ids [batch, seq] -> next-token logits [batch, seq, vocab]."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.token_embeddings = Embedding(config.vocab_size, config.d_model)
        # One table shared by all layers: every layer rotates by the same angles.
        self.rotary = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.final_norm = RMSNorm(config.d_model)
        self.lm_head = Linear(config.d_model, config.vocab_size)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if token_ids.dim() != 2:
            raise ValueError(
                f"token_ids must have shape [batch, seq], got shape {tuple(token_ids.shape)}"
            )
        seq_len = token_ids.shape[1]
        if seq_len > self.config.context_length:
            raise ValueError(
                f"sequence of {seq_len} tokens exceeds the context length "
                f"{self.config.context_length} this model was built for"
            )
        x = self.token_embeddings(token_ids)
        for layer in self.layers:
            x = layer(x, self.rotary)
        return self.lm_head(self.final_norm(x))
