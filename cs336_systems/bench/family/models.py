"""The model family: four shapes of gradient that one bucket-size rule must serve.

Every member maps token ids ``[rows, context]`` to logits ``[rows, context, vocab]``, so the
step benchmark's training step (cross-entropy on the next token) trains each of them unchanged.
Sizes are chosen so that a step takes tens to hundreds of milliseconds on one CPU thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from cs336_basics.model import TransformerLM, model_config


class ManySmall(nn.Module):
    """A deep stack of narrow residual layers: hundreds of parameters of a few KB each."""

    def __init__(self, vocab: int, width: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + torch.relu(layer(h))
        return self.head(h)


class FewHuge(nn.Module):
    """One wide feed-forward block: almost every byte of gradient in two 16 MB matrices."""

    def __init__(self, vocab: int, width: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.down(torch.nn.functional.gelu(self.up(h))))


class StockEncoder(nn.Module):
    """Stock ``torch.nn.TransformerEncoderLayer`` blocks between an embedding and a head."""

    def __init__(self, vocab: int, width: int, heads: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


@dataclass(frozen=True)
class FamilyMember:
    """One model of the family and the batch it trains on."""

    name: str
    shape: str  # what its gradients look like, for the writeup
    build: Callable[[], nn.Module]
    vocab: int
    context_length: int
    global_batch: int  # sequences per step over all ranks


FAMILY: dict[str, FamilyMember] = {m.name: m for m in (
    FamilyMember("many-small", "many small parameters: a deep stack of narrow residual layers",
                 lambda: ManySmall(512, 128, 48), 512, 64, 8),
    FamilyMember("few-huge", "a few huge parameters: one wide feed-forward block",
                 lambda: FewHuge(512, 1024, 4096), 512, 32, 4),
    FamilyMember("torch-encoder", "stock torch.nn layers: TransformerEncoderLayer blocks between an embedding "
                 "and a head", lambda: StockEncoder(1000, 256, 4, 4), 1000, 64, 4),
    FamilyMember("lm-cpu-small", "our Transformer LM at cpu-small, the step benchmark's CPU workload",
                 lambda: TransformerLM(model_config("cpu-small", 128)), 10_000, 128, 4),
)}
