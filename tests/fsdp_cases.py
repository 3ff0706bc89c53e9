"""Training cases for the FSDP tests: models, data, the single-process reference, rank runners.

``run_fsdp_cases`` trains every case inside one spawned process group (a spawn costs seconds,
a case milliseconds) and returns, per case, every step's full parameters as
``fsdp_gather_full_params`` reports them, plus what each rank saw of its gradients. A case runs
either FSDP mode: reduce-scatter (the library default, ``get_fsdp``) or exact gradients
(``get_fsdp_exact``).
``train_reference`` trains the same case in this process without ``torch.distributed``, either
on the whole batch (the real reference) or chunk by chunk as the ranks split it, summing the
chunks' gradients in rank order (data parallelism's own arithmetic, to compare bitwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import adapters
from cs336_basics.model import Embedding, Linear, RMSNorm
from cs336_systems.launch import RankContext

BATCH = 12  # sequences per step: divisible by world sizes 2 and 3
SEQ = 5
VOCAB = 13  # 13 x 8 embedding: 104 elements, uneven over 3 ranks (35, 35, 34 + 1 padding)
D_MODEL = 8
D_HIDDEN = 10


class TiedLM(nn.Module):
    """Embedding tied to the LM head, an RMSNorm gain and a bias (replicated), a torch
    ``nn.Linear`` beside ours, and a free-standing replicated scale."""

    def __init__(self):
        super().__init__()
        self.embedding = Embedding(VOCAB, D_MODEL)
        self.norm = RMSNorm(D_MODEL)
        self.up = Linear(D_MODEL, D_HIDDEN)
        self.down = nn.Linear(D_HIDDEN, D_MODEL)  # torch's, with a replicated bias
        self.lm_head = Linear(D_MODEL, VOCAB)
        self.lm_head.weight = self.embedding.weight  # tied: one Parameter, two uses
        self.scale = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embedding(tokens))
        h = h + self.down(F.gelu(self.up(h)))
        return self.lm_head(h) * self.scale


class TiedLayers(TiedLM):
    """TiedLM without the free-standing scale: every trainable parameter belongs to a leaf
    layer, so exact-gradient mode recomputes all of them over the global batch."""

    def __init__(self):
        super().__init__()
        del self.scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embedding(tokens))
        h = h + self.down(F.gelu(self.up(h)))
        return self.lm_head(h)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = Linear(D_MODEL, D_HIDDEN)
        self.down = nn.Linear(D_HIDDEN, D_MODEL)  # torch's, with a replicated bias
        self.spare = Linear(D_MODEL, D_MODEL)  # never called: no gradient, no update

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class BlockLM(nn.Module):
    """Blocks in an ``nn.ModuleList``, which our FSDP gathers and reduces a block at a time
    (cs336_systems/fsdp/unit.py), with what makes a block's collective awkward: a weight tied
    across two blocks (its gradient complete only after both), a layer no forward calls (in the
    block's gathers, in none of its reductions), and uneven shards at 3 ranks; the embedding is
    tied to the head outside the blocks."""

    def __init__(self):
        super().__init__()
        self.embedding = Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.blocks[1].up.weight = self.blocks[0].up.weight
        self.norm = RMSNorm(D_MODEL)
        self.lm_head = Linear(D_MODEL, VOCAB)
        self.lm_head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.norm(h))


MODELS = {"tied": TiedLM, "layers": TiedLayers, "blocks": BlockLM}
# Per model: the parameters sharded and replicated, by name (a tied weight by its first name).
SHARDED = {
    "tied": {"embedding.weight", "up.weight", "down.weight"},
    "layers": {"embedding.weight", "up.weight", "down.weight"},
    "blocks": {"embedding.weight", "blocks.0.up.weight", "blocks.0.down.weight", "blocks.1.down.weight",
               "blocks.0.spare.weight", "blocks.1.spare.weight"},
}
REPLICATED = {
    "tied": {"norm.gain", "down.bias", "scale"},
    "layers": {"norm.gain", "down.bias"},
    "blocks": {"norm.gain", "blocks.0.down.bias", "blocks.1.down.bias"},
}
UNUSED = {"blocks.0.spare.weight", "blocks.1.spare.weight"}  # no gradient ever


class LayerStack(nn.Module):
    """Equal square layers: the memory case (at most two layers' weights gathered at once)."""

    def __init__(self, width: int = 96, depth: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


ADAMW_LR = 1e-2  # AdamW's first updates are about lr * sign(gradient) per element

@dataclass(frozen=True)
class Case:
    """One training run, identical in the FSDP ranks and in the single-process reference."""

    name: str
    optimizer: str  # "sgd" (momentum 0.9) or "adamw"
    compute_dtype: torch.dtype | None = None
    exact: bool = False  # exact-gradient mode (get_fsdp_exact) or reduce-scatter (get_fsdp)
    model: str = "tied"  # a key of MODELS
    steps: int = 3
    seed: int = 0

    @property
    def exact_at_world_size_2(self) -> bool:
        """Exact mode on a model without a module-level parameter, in float32: bitwise."""
        return self.exact and self.model == "layers" and self.compute_dtype is None


_DTYPES = (("fp32", None), ("fp16", torch.float16), ("bf16", torch.bfloat16))
CASES = [
    *(Case(f"{opt}-{label}", opt, dtype) for opt in ("sgd", "adamw") for label, dtype in _DTYPES),
    *(
        Case(f"exact-{model}-{opt}-fp32", opt, None, exact=True, model=model)
        for model in ("layers", "tied")
        for opt in ("sgd", "adamw")
    ),
    Case("exact-layers-sgd-fp16", "sgd", torch.float16, exact=True, model="layers"),
    Case("exact-tied-adamw-bf16", "adamw", torch.bfloat16, exact=True, model="tied"),
    Case("blocks-sgd-fp32", "sgd", model="blocks"),
    Case("blocks-adamw-bf16", "adamw", torch.bfloat16, model="blocks"),
]


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=ADAMW_LR, weight_decay=0.1)


def build_model(case: Case, rank: int) -> TiedLM:
    torch.manual_seed(1_000 * (case.seed + 1) + rank)  # ranks start different on purpose
    return MODELS[case.model]()


def wrap(case: Case, module: nn.Module) -> nn.Module:
    get = adapters.get_fsdp_exact if case.exact else adapters.get_fsdp
    return get(module, compute_dtype=case.compute_dtype)


def batch(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of a step: fresh tokens each step (reshuffled data), every rank alike."""
    g = torch.Generator().manual_seed(10_000 * case.seed + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def cast_like_fsdp(model: nn.Module, dtype: torch.dtype) -> None:
    """Make single-process training compute as FSDP with ``compute_dtype=dtype`` does.

    Each Linear/Embedding call uses its fp32 weight (and bias) cast to ``dtype`` (a
    differentiable cast, so the gradient comes back to the fp32 master through the cast's
    backward, summed over a tied weight's uses in fp32); everything else is untouched.
    """
    masters: dict[tuple[nn.Module, str], nn.Parameter] = {}

    def cast(m, args):
        for name in ("weight", "bias"):
            if m._parameters.get(name) is not None:
                masters[(m, name)] = m._parameters[name]
                m._parameters[name] = masters[(m, name)].to(dtype)

    def restore(m, args, out):
        for name in ("weight", "bias"):
            if (m, name) in masters:
                m._parameters[name] = masters.pop((m, name))

    for module in model.modules():
        if isinstance(module, (Linear, Embedding, nn.Linear, nn.Embedding)):
            module.register_forward_pre_hook(cast)
            module.register_forward_hook(restore)


def train_reference(case: Case, chunks: int = 1) -> list[dict[str, torch.Tensor]]:
    """Single-process training; the parameters after every step.

    ``chunks=1``: the whole batch, the reference FSDP must match. ``chunks=n``: each of the n
    rank-sized slices backpropagated on its own, gradients summed in rank order then divided
    by n, which is the arithmetic of data parallelism and so comparable bitwise.
    """
    model = build_model(case, rank=0)
    if case.compute_dtype is not None:
        cast_like_fsdp(model, case.compute_dtype)
    optimizer = make_optimizer(case.optimizer, model.parameters())
    history = []
    for step in range(case.steps):
        optimizer.zero_grad(set_to_none=True)
        tokens, targets = batch(case, step)
        grads: dict[str, torch.Tensor] = {}
        for tok, tgt in zip(tokens.chunk(chunks), targets.chunk(chunks)):
            model.zero_grad(set_to_none=True)
            loss_of(model(tok), tgt).backward()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    grads[name] = p.grad if name not in grads else grads[name] + p.grad
        for name, p in model.named_parameters():
            if name in grads:
                p.grad = grads[name] / chunks if chunks > 1 else grads[name]
        optimizer.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history


def _run_case(ctx: RankContext, case: Case) -> dict:
    fsdp = wrap(case, build_model(case, ctx.rank))
    optimizer = make_optimizer(case.optimizer, fsdp.parameters())
    shard = BATCH // ctx.world_size
    rows = slice(ctx.rank * shard, (ctx.rank + 1) * shard)
    history, grads = [], []
    for step in range(case.steps):
        optimizer.zero_grad(set_to_none=True)
        tokens, targets = batch(case, step)
        loss_of(fsdp(tokens[rows]), targets[rows]).backward()
        adapters.fsdp_on_after_backward(fsdp, optimizer)
        grads.append({
            n: (tuple(p.shape), p.grad.dtype, tuple(p.grad.shape), p.grad.clone())
            for n, p in fsdp.module.named_parameters() if p.grad is not None
        })
        optimizer.step()
        history.append(adapters.fsdp_gather_full_params(fsdp))
    return {"history": history, "grads": grads}


def run_fsdp_cases(ctx: RankContext, cases: list[Case]) -> dict:
    """Rank function: every training case, then the misuse checks and the memory probe."""
    from tests.fsdp_probes import (
        backward_ends_the_step,
        exact_mode_misuse,
        probe_backward_flops,
        probe_memory_and_overlap,
    )

    results = {case.name: _run_case(ctx, case) for case in cases}
    results["backward_ends_the_step"] = backward_ends_the_step(ctx)
    results["exact_misuse"] = exact_mode_misuse(ctx)
    results["backward_flops"] = probe_backward_flops(ctx)
    results["memory"] = {
        mode: probe_memory_and_overlap(ctx, exact=mode == "exact") for mode in ("reduce_scatter", "exact")
    }
    return results
