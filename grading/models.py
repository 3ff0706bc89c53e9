"""The suite's models: built in a rank to train through a submission, and in the grader as the reference.

``Net`` and ``Equal`` are plain torch, so the grader builds the very same module from the same
weights. The FSDP test's language model must use the submission's own ``Linear`` and
``Embedding`` (an FSDP shards layers of those classes), which the grader never imports: a rank
builds ``StudentLM`` from them and reports every layer's initial parameters, and the grader
builds ``ReferenceLM`` from that report, with the handout's meaning of each layer (a Linear
maps ``x`` to ``x W^T`` with ``W`` of shape (out, in); ``x W`` is accepted for (in, out)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from grading import probes

WIDTH = 16


class Net(nn.Module):
    """An MLP with a probe after its first layer (collectives before the probe's backward overlapped
    backward), a frozen bias, a parameter that never requires grad and, optionally, tied weights
    and a layer no rank ever uses."""

    def __init__(self, tied: bool = False, unused: bool = False, depth: int = 4, width: int = WIDTH):
        super().__init__()
        self.first = nn.Linear(8, width)
        self.probe = probes.BackwardProbe()
        self.hidden = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))
        self.frozen = nn.Linear(width, width)
        self.frozen.bias.requires_grad_(False)
        self.head = nn.Linear(width, 4)
        self.fixed = nn.Parameter(torch.full((2,), 2.0), requires_grad=False)
        if tied:  # one weight used by two layers
            self.hidden[-1].weight = self.hidden[0].weight
        if unused:
            self.never_used = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.probe(torch.tanh(self.first(x)))
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        return self.head(torch.tanh(self.frozen(h)))


class Equal(nn.Module):
    """Layers of one size, no bias: bucket counts follow from the cap alone."""

    def __init__(self, layers: int = 8, width: int = 32):
        super().__init__()
        self.first = nn.Linear(8, width, bias=False)
        self.probe = probes.BackwardProbe()
        self.hidden = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
        self.head = nn.Linear(width, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.probe(self.first(x))
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        return self.head(h)


def build(model: str, layers: int = 8) -> nn.Module:
    """"net", "tied", "unused" or "equal"."""
    if model == "equal":
        return Equal(layers=layers)
    return Net(tied=model == "tied", unused=model == "unused")


# AdamW's first step is lr·g/(|g| + eps): with the default eps (1e-8) a gradient near 0 turns a
# float32 rounding difference (another summation order over ranks) into up to lr in the weight,
# and a correct submission failed 1 run in 4; eps = 1e-3 bounds that to lr/eps = 10 times it.
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-3}


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, **ADAMW)


def optimizer_class(kind: str) -> tuple[type[torch.optim.Optimizer], dict]:
    """The class and keyword arguments the sharded optimizer is given."""
    if kind == "adamw":
        return torch.optim.AdamW, dict(ADAMW)
    return torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}


@dataclass(frozen=True)
class LMShape:
    vocab: int
    d_model: int
    d_ff: int


class Norm(nn.Module):
    """The suite's own RMS norm: neither a Linear nor an Embedding, so an FSDP replicates it."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


LM_LAYERS = ("embedding", "norm", "up", "down", "lm_head")


def lm_forward(lm: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    h = lm.norm(lm.embedding(ids))
    h = h + lm.down(torch.relu(lm.up(h)))
    return lm.lm_head(h)


def student_lm(shape: LMShape) -> nn.Module:
    """The FSDP test's model from the submission's ``cs336_basics.model`` (in a rank only)."""
    from cs336_basics.model import Embedding, Linear  # the submission's own

    class StudentLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = Embedding(shape.vocab, shape.d_model)
            self.norm = Norm(shape.d_model)
            self.up = Linear(shape.d_model, shape.d_ff)
            self.down = Linear(shape.d_ff, shape.d_model)
            self.lm_head = Linear(shape.d_model, shape.vocab)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return lm_forward(self, ids)

    return StudentLM()


class _Layer(nn.Module):
    """One reference layer holding the parameters a rank reported under their own names."""

    def __init__(self, kind: str, params: dict[str, torch.Tensor], dims: tuple[int, int]):
        super().__init__()
        self.kind, self.dims, self.names = kind, dims, list(params)
        for name, value in params.items():
            self.register_parameter(name, nn.Parameter(value.detach().clone().float()))
        weights = [n for n in self.names if getattr(self, n).dim() == 2]
        biases = [n for n in self.names if getattr(self, n).dim() == 1]
        if len(weights) != 1 or len(biases) > 1:
            raise ValueError(f"a {kind} layer with parameters {describe(params)}: expected one weight "
                             "matrix (and at most one bias)")
        self.weight_name, self.bias_name = weights[0], biases[0] if biases else None
        rows, cols = getattr(self, self.weight_name).shape
        if kind == "embedding":
            if (rows, cols) != dims:
                raise ValueError(f"an Embedding weight of shape {(rows, cols)}, expected {dims}")
        elif (rows, cols) not in (dims[::-1], dims):
            raise ValueError(f"a Linear weight of shape {(rows, cols)} for {dims[0]} → {dims[1]} features")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = getattr(self, self.weight_name)
        if self.kind == "embedding":
            return F.embedding(x, weight)
        bias = getattr(self, self.bias_name) if self.bias_name else None
        if tuple(weight.shape) == self.dims[::-1]:  # (out, in): the handout's y = x W^T
            return F.linear(x, weight, bias)
        return x @ weight + (0 if bias is None else bias)


class ReferenceLM(nn.Module):
    """``StudentLM``'s computation in plain torch, from the initial parameters a rank reported
    (``{"up.weight": tensor, ...}``: names as the rank's model gave them)."""

    def __init__(self, shape: LMShape, params: dict[str, torch.Tensor]):
        super().__init__()
        dims = {"embedding": (shape.vocab, shape.d_model), "up": (shape.d_model, shape.d_ff),
                "down": (shape.d_ff, shape.d_model), "lm_head": (shape.d_model, shape.vocab)}
        for layer in LM_LAYERS:
            mine = {k.removeprefix(f"{layer}."): v for k, v in params.items() if k.startswith(f"{layer}.")}
            if layer == "norm":
                self.norm = Norm(shape.d_model)
                self.norm.weight.data.copy_(mine["weight"])
            else:
                self.add_module(layer, _Layer(layer, mine, dims[layer]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return lm_forward(self, ids)


def describe(params: dict[str, torch.Tensor]) -> str:
    return ", ".join(f"{k} {'×'.join(map(str, v.shape))}" for k, v in params.items()) or "none"
