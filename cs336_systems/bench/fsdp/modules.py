"""The models FSDP2 users shard, built alike for our ``fully_shard`` and torch's (issue 41).

Six cases, each a model, how it is sharded and how it computes:

* ``encoder``: torch's ``nn.TransformerEncoder`` (its layers' ``nn.MultiheadAttention`` reads
  ``in_proj_weight`` without calling a Linear) between an input projection and a head, sharded
  once at the root: one unit, every parameter in it;
* ``attention``: blocks of our own around ``nn.MultiheadAttention`` called directly (causal
  mask, pre-norm, an MLP), each block a unit, then the root;
* ``nested``: the ``encoder`` model sharded per layer, then the root (every FSDP2 recipe);
* ``tied``: a language model whose token embedding is its head's weight, per block then root;
* ``frozen``: ``nested`` with its first layer and the head's bias not trained;
* ``bf16``: ``nested`` computing in bfloat16 from float32 inputs (torch's side:
  ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``).

Each side shards the same seeded model in place and trains it with AdamW, each rank on its rows
of the global batch. tests/test_fsdp_any_module.py trains these models at :data:`TEST_SHAPE` and
compares weights and bytes; the benchmark (modules_run.py) times them at a larger shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

OURS, TORCH = "ours", "torch"
CLASSES = 3  # the float-input models' head: a class per position
# AdamW normalises each step: a parameter whose true gradient is zero (the key part of
# in_proj_bias: softmax ignores a shift of every key) moves by lr on rounding noise alone,
# whatever its sign. An eps above that noise (about 1e-9 at the test's shape) keeps such
# steps at noise size, on both sides alike.
EPS = 1e-4


@dataclass(frozen=True)
class ModelShape:
    """Sizes of every case's model."""

    d_model: int  # width of the residual stream
    num_heads: int  # attention heads
    d_ff: int  # inner width of each block's feed-forward
    num_layers: int  # blocks
    vocab_size: int  # the tied LM's tokens


TEST_SHAPE = ModelShape(d_model=16, num_heads=2, d_ff=24, num_layers=2, vocab_size=23)


class Encoder(nn.Module):
    """torch's TransformerEncoder between a float input projection and a head."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        layer = nn.TransformerEncoderLayer(shape.d_model, shape.num_heads, shape.d_ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, shape.num_layers, enable_nested_tensor=False)
        self.head = nn.Linear(shape.d_model, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def blocks(self) -> list[nn.Module]:
        return list(self.encoder.layers)


class AttentionBlock(nn.Module):
    """Pre-norm causal self-attention through ``nn.MultiheadAttention``, then an MLP."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.attention_norm = nn.LayerNorm(shape.d_model)
        self.attention = nn.MultiheadAttention(shape.d_model, shape.num_heads, batch_first=True)
        self.mlp_norm = nn.LayerNorm(shape.d_model)
        self.up = nn.Linear(shape.d_model, shape.d_ff)
        self.down = nn.Linear(shape.d_ff, shape.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class AttentionModel(nn.Module):
    """Float inputs through :class:`AttentionBlock` s to a head."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.layers = nn.ModuleList(AttentionBlock(shape) for _ in range(shape.num_layers))
        self.head = nn.Linear(shape.d_model, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)


class TiedLM(nn.Module):
    """Token embedding tied to the LM head, encoder layers between, a final LayerNorm."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.embed = nn.Embedding(shape.vocab_size, shape.d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(shape.d_model, shape.num_heads, shape.d_ff, dropout=0.0, batch_first=True,
                                       norm_first=True)
            for _ in range(shape.num_layers)
        )
        self.norm = nn.LayerNorm(shape.d_model)
        self.head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)


MODELS = {"encoder": Encoder, "attention": AttentionModel, "tied": TiedLM}


@dataclass(frozen=True)
class ModuleCase:
    """One model and how it is sharded; ``frozen`` names parameters (by prefix) that do not train."""

    name: str
    model: str  # a key of MODELS
    description: str
    per_block: bool = True  # each block a unit before the root; False: the root alone
    compute_dtype: torch.dtype | None = None
    frozen: tuple[str, ...] = ()

    @property
    def takes_tokens(self) -> bool:
        return self.model == "tied"


CASES = (
    ModuleCase("encoder", "encoder", "nn.TransformerEncoder, sharded at the root only", per_block=False),
    ModuleCase("attention", "attention", "own blocks around nn.MultiheadAttention, per block then root"),
    ModuleCase("nested", "encoder", "nn.TransformerEncoder, per layer then root"),
    ModuleCase("tied", "tied", "LM with its embedding tied to its head, per block then root"),
    ModuleCase("frozen", "encoder", "nested, first layer and head bias frozen",
               frozen=("encoder.layers.0.", "head.bias")),
    ModuleCase("bf16", "encoder", "nested, bf16 compute from float32 inputs", compute_dtype=torch.bfloat16),
)


def build(case: ModuleCase, shape: ModelShape, seed: int = 0) -> nn.Module:
    """The case's model, the same on every rank (seeded), its frozen parameters frozen."""
    torch.manual_seed(seed)
    model = MODELS[case.model](shape)
    for name, p in model.named_parameters():
        if name.startswith(case.frozen):
            p.requires_grad_(False)
    return model


def batch(case: ModuleCase, shape: ModelShape, rows: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of ``rows`` sequences: (inputs, targets), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    if not case.takes_tokens:
        return torch.randn(rows, seq, shape.d_model, generator=g), torch.randint(0, CLASSES, (rows, seq), generator=g)
    tokens = torch.randint(0, shape.vocab_size, (rows, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over positions, in float32 whatever the model computed in."""
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


def shard(case: ModuleCase, side: str, model: nn.Module) -> nn.Module:
    """Shard ``model`` in place as ``case`` says, with our ``fully_shard`` (OURS) or torch's (TORCH),
    over the default process group (a collective: every rank calls it alike)."""
    if side == TORCH:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # The mesh over the group already joined, on the model's device (without one, fully_shard
        # picks CUDA wherever a GPU is visible, configurations.py says why that fails here).
        mesh = DeviceMesh.from_group(dist.group.WORLD, next(model.parameters()).device.type)
        policy = MixedPrecisionPolicy(param_dtype=case.compute_dtype, reduce_dtype=torch.float32)
        for block in model.blocks() if case.per_block else ():
            fully_shard(block, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, mp_policy=policy)
    if side != OURS:
        raise ValueError(f"side must be {OURS!r} or {TORCH!r}, got {side!r}")
    from cs336_systems.fsdp import fully_shard as ours

    for block in model.blocks() if case.per_block else ():
        ours(block, compute_dtype=case.compute_dtype)
    return ours(model, compute_dtype=case.compute_dtype)


def full_params(side: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by name (a collective)."""
    if side == TORCH:
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return model.gather_full_params()


def trained(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer steps (not the frozen ones)."""
    return [p for p in model.parameters() if p.requires_grad]
