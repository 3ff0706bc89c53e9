"""What the library adds to the answers: each row one situation, checked on both implementations.

A *row* is something torch's DDP, ZeRO or FSDP users rely on and the handout does not ask for.
Its check trains or probes one implementation ("answers": cs336_systems/answers/, "library":
ddp/, zero/, fsdp/) inside spawned ranks and returns "" when it behaves as single-process training
(or torch) does, else one line saying what went wrong. Every check fails alike on every rank
(an error raised on all of them, or a wrong value), so no rank waits for another that gave up.
``ROWS`` also names, for writeup/details/from_answer_to_library.md, the library code that
handles the situation; tests/test_answer_vs_library.py counts its lines.

All DDP and ZeRO rows run in one spawn of 2 ranks, all FSDP rows in one of 3 (a spawn costs
seconds, a row milliseconds).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from cs336_basics.model import Embedding, Linear, RMSNorm
from cs336_systems.answers.ddp_bucketed import DDPBucketed
from cs336_systems.answers.ddp_overlap_individual_parameters import DDPIndividualParameters
from cs336_systems.answers.fsdp import FSDP
from cs336_systems.answers.sharded_optimizer import ShardedOptimizer as AnswerShardedOptimizer
from cs336_systems.ddp import VARIANTS
from cs336_systems.fsdp import FullyShardedDataParallel
from cs336_systems.launch import RankContext
from cs336_systems.zero import ShardedOptimizer
from tests.common import SmallCNN

IMPLS = ("answers", "library")
TOLERANCE = 1e-5  # float32 sums in another order than one process's: ulps of weights near 1
WIDTH = 32
BUCKET_MB = 2 * WIDTH * WIDTH * 4 / 2**20  # two of the layers' weights per bucket


def per_parameter(impl: str, module: nn.Module) -> nn.Module:
    return DDPIndividualParameters(module) if impl == "answers" else VARIANTS["per-parameter"].wrap(module)


def bucketed(impl: str, module: nn.Module, bucket_size_mb: float = BUCKET_MB) -> nn.Module:
    if impl == "answers":
        return DDPBucketed(module, bucket_size_mb)
    return VARIANTS["bucketed"].wrap(module, bucket_size_mb=bucket_size_mb)


def fsdp(impl: str, module: nn.Module, **options) -> nn.Module:
    return FSDP(module, **options) if impl == "answers" else FullyShardedDataParallel(module, **options)


# ---- models ----------------------------------------------------------------------------------
class Stack(nn.Module):
    """Eight square layers; ``order`` is the order forward calls them (registration: 0..7), and
    ``unused`` adds a layer forward never calls."""

    def __init__(self, order: tuple[int, ...] = tuple(range(8)), unused: bool = False):
        super().__init__()
        self.first = nn.Linear(8, WIDTH, bias=False)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(8))
        self.head = nn.Linear(WIDTH, 4, bias=False)
        self.never_used = nn.Linear(WIDTH, WIDTH) if unused else None
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        for i in self.order:
            h = torch.tanh(self.layers[i](h))
        return self.head(h)


class LM(nn.Module):
    """The course's layers: embedding, norm, two Linears and a head, maybe tied to the embedding."""

    def __init__(self, vocab: int = 12, d_model: int = 6, d_ff: int = 12, tied: bool = False):
        super().__init__()
        self.embedding = Embedding(vocab, d_model)
        self.norm = RMSNorm(d_model)
        self.up = Linear(d_model, d_ff)
        self.down = Linear(d_ff, d_model)
        self.lm_head = Linear(d_model, vocab)
        if tied:
            self.lm_head.weight = self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embedding(ids))
        return self.lm_head(h + self.down(torch.relu(self.up(h))))


# ---- training against one process --------------------------------------------------------------
def _batch(step: int, shape: tuple[int, ...], vocab: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if vocab:
        ids = torch.randint(0, vocab, (12, *shape), generator=g)
        return ids, torch.roll(ids, -1, dims=1)
    return torch.randn(12, *shape, generator=g), torch.randn(12, 4, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target.dtype == torch.long:
        return F.cross_entropy(out.float().flatten(0, 1), target.flatten())
    return F.mse_loss(out, target)


def _mismatch(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], step: int) -> str:
    for name, value in want.items():
        if name not in got or got[name].shape != value.shape:
            return f"after step {step}, {name} is {None if name not in got else tuple(got[name].shape)}, not {tuple(value.shape)}"
        diff = (got[name].float() - value.float()).abs().max().item()
        if diff > TOLERANCE:
            return f"after step {step}, {name} differs from single-process training by {diff:.2e} (tolerance {TOLERANCE})"
    return ""


def train_against_one_process(ctx: RankContext, make: Callable[[], nn.Module], wrap: Callable[[nn.Module], nn.Module],
                              finish: Callable[[nn.Module], None], shape, vocab: int = 0, steps: int = 3,
                              full_params: Callable[[nn.Module], dict] | None = None) -> str:
    torch.manual_seed(0)
    reference = make()
    torch.manual_seed(ctx.rank + 1)  # ranks start different: the wrapper must broadcast rank 0's
    local = make()
    if ctx.rank == 0:
        local.load_state_dict(reference.state_dict())
    model = wrap(local)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    rows = slice(ctx.rank * 12 // ctx.world_size, (ctx.rank + 1) * 12 // ctx.world_size)
    for step in range(1, steps + 1):
        x, y = _batch(step, shape, vocab)
        ref_opt.zero_grad()
        _loss(reference(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        _loss(model(x[rows]), y[rows]).backward()
        finish(model)
        opt.step()
        got = full_params(model) if full_params else dict(model.module.named_parameters())
        found = _mismatch(got, dict(reference.named_parameters()), step)
        if found:
            return found
    return ""


def _ddp_finish(model: nn.Module) -> None:
    model.finish_gradient_synchronization()


# ---- DDP and ZeRO rows (world size 2) ----------------------------------------------------------
def unused_parameter(ctx: RankContext, impl: str) -> str:
    """A layer forward never calls (torch's DDP: find_unused_parameters=True)."""
    return train_against_one_process(ctx, lambda: Stack(unused=True), lambda m: bucketed(impl, m), _ddp_finish, (8,))


def _running_means(model: nn.Module) -> float:
    mean = model.module.bn.running_mean.clone()
    gathered = [torch.zeros_like(mean) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mean)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def batchnorm_buffers(ctx: RankContext, impl: str) -> str:
    """BatchNorm's running statistics, computed from each rank's own data (torch's DDP:
    broadcast_buffers=True, rank 0's buffers at each forward)."""
    torch.manual_seed(0)
    model = per_parameter(impl, SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * ctx.rank + step)
        x = (1 + ctx.rank) * torch.randn(4, 3, 6, 6, generator=g)  # each rank's data of its own scale
        opt.zero_grad()
        F.mse_loss(model(x), torch.zeros(4, 4)).backward()
        model.finish_gradient_synchronization()
        opt.step()
    model(torch.randn(4, 3, 6, 6))  # the forward that would evaluate the model: buffers agree at its start
    spread = _running_means(model)
    return "" if spread == 0 else f"rank 1's BatchNorm running mean differs from rank 0's by {spread:.3f}: the replicas disagree"


def no_sync_accumulation(ctx: RankContext, impl: str) -> str:
    """Gradient accumulation: micro-batches under no_sync() communicate nothing, then one
    synchronised backward reduces the sum (torch's DDP.no_sync)."""
    model = per_parameter(impl, Stack())
    if not hasattr(model, "no_sync"):
        return f"{type(model).__name__} has no no_sync(): every micro-batch's backward all-reduces every gradient"
    torch.manual_seed(0)
    reference = Stack()
    model.module.load_state_dict(reference.state_dict())
    x, y = _batch(0, (8,))
    for half in (slice(0, 6), slice(6, 12)):  # two micro-batches, the whole batch the reference sees
        _loss(reference(x[half]), y[half]).backward()
    rows = [slice(ctx.rank * 3, ctx.rank * 3 + 3), slice(6 + ctx.rank * 3, 6 + ctx.rank * 3 + 3)]
    with model.no_sync():
        _loss(model(x[rows[0]]), y[rows[0]]).backward()
    _loss(model(x[rows[1]]), y[rows[1]]).backward()
    model.finish_gradient_synchronization()
    want = {n: p.grad for n, p in reference.named_parameters()}
    return _mismatch({n: p.grad for n, p in model.module.named_parameters()}, want, 1).replace("differs", "'s gradient differs")


def gradient_views(ctx: RankContext, impl: str) -> str:
    """Each .grad a view into its bucket's buffer, so no copy back and no second copy of the
    gradients in memory (torch's DDP: gradient_as_bucket_view=True)."""
    model = bucketed(impl, Stack())
    for _ in range(2):
        x, y = _batch(0, (8,))
        model.zero_grad(set_to_none=False)
        _loss(model(x), y).backward()
        model.finish_gradient_synchronization()
    storages = {p.grad.untyped_storage().data_ptr() for p in model.module.parameters()}
    buckets = len(model.buckets)
    return "" if len(storages) <= buckets else (
        f"{len(storages)} gradient storages for {buckets} buckets: every bucket's gradients are copied out of it, "
        "and the gradients are held twice while it is reduced")


def backward_order(ctx: RankContext, impl: str) -> str:
    """A model whose forward calls its layers in another order than it registers them (odd
    layers, then even ones): buckets made in reverse registration order each hold one gradient
    backward produces early and one it produces late, so none is full before half of backward
    is done; torch's DDP rebuilds its buckets in the order the first backward produced them."""
    model = bucketed(impl, Stack(order=(1, 3, 5, 7, 0, 2, 4, 6)))
    params = [p for p in model.module.parameters()]
    ready = [0]
    for p in params:  # after the wrapper's own hooks: counts gradients already handed to it
        p.register_post_accumulate_grad_hook(lambda p: ready.__setitem__(0, ready[0] + 1))
    first_launch: list[int] = []
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        if not first_launch:
            first_launch.append(ready[0])
        return original(tensor, *args, **kwargs)

    for step in range(2):  # the first step may learn the order
        x, y = _batch(step, (8,))
        model.zero_grad()
        ready[0], first_launch[:] = 0, []
        dist.all_reduce = all_reduce
        try:
            _loss(model(x), y).backward()
        finally:
            dist.all_reduce = original
        model.finish_gradient_synchronization()
    # Buckets of two gradients each: one filled in backward's order launches by the second.
    return "" if first_launch[0] <= 2 else (
        f"the first all-reduce of step 2 started after {first_launch[0]} of {len(params)} gradients were ready: "
        "the buckets follow registration order, not the order backward produces gradients")


def optimizer_checkpoint(ctx: RankContext, impl: str) -> str:
    """Saving the sharded optimizer (state_dict) and resuming from it gives the run that never
    stopped (torch's ZeroRedundancyOptimizer: consolidate_state_dict / load_state_dict)."""
    cls = AnswerShardedOptimizer if impl == "answers" else ShardedOptimizer
    runs = []
    for resume in (False, True):
        torch.manual_seed(0)
        model = Stack()
        opt = cls(model.parameters(), torch.optim.AdamW, lr=1e-2)
        for step in range(3):
            if resume and step == 2:
                saved = opt.state_dict()
                opt = cls(model.parameters(), torch.optim.AdamW, lr=1e-2)
                opt.load_state_dict(saved)
            x, y = _batch(step, (8,))
            opt.zero_grad()
            _loss(model(x), y).backward()
            opt.step()
        runs.append(dict(model.named_parameters()))
    return _mismatch(runs[1], runs[0], 3).replace("single-process training", "the run without a resume")


DDP_ROWS = (unused_parameter, batchnorm_buffers, no_sync_accumulation, gradient_views, backward_order,
            optimizer_checkpoint)


# ---- FSDP rows (world size 3) ------------------------------------------------------------------
def _fsdp_train(ctx: RankContext, impl: str, make: Callable[[], nn.Module], vocab: int, **options) -> str:
    return train_against_one_process(ctx, make, lambda m: fsdp(impl, m, **options), _ddp_finish, (5,), vocab=vocab,
                                     full_params=lambda m: m.gather_full_params())


def uneven_shards(ctx: RankContext, impl: str) -> str:
    """Weights whose leading dimension the world size does not divide (vocabulary 13, 3 ranks)."""
    return _fsdp_train(ctx, impl, lambda: LM(vocab=13, d_model=8, d_ff=10), 13)


def tied_weights(ctx: RankContext, impl: str) -> str:
    """The LM head tied to the embedding: one parameter used by two sharded layers."""
    return _fsdp_train(ctx, impl, lambda: LM(tied=True), 12)


def full_state_dict(ctx: RankContext, impl: str) -> str:
    """A checkpoint of the whole model through torch's own helper (get_model_state_dict), as
    fully_shard's users write one: the full weights, loadable into the unwrapped model."""
    torch.manual_seed(0)
    model = fsdp(impl, LM())
    state = get_model_state_dict(model.module, options=StateDictOptions(full_state_dict=True))
    full = model.gather_full_params()
    for name, value in full.items():
        got = state.get(name)
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        if got is None or tuple(got.shape) != tuple(value.shape) or not torch.equal(got, value):
            return (f"the full state dict's {name} is {None if got is None else tuple(got.shape)}, not the full "
                    f"{tuple(value.shape)} weight: a checkpoint of this rank's shard only")
    return ""


def reduce_dtype(ctx: RankContext, impl: str) -> str:
    """Gradients reduce-scattered in bfloat16, half the bytes, master weights in float32 (torch's
    MixedPrecisionPolicy(reduce_dtype=...))."""
    seen: list[torch.dtype] = []
    original = dist.reduce_scatter_tensor

    def reduce_scatter_tensor(output, input, *args, **kwargs):
        seen.append(input.dtype)
        return original(output, input, *args, **kwargs)

    dist.reduce_scatter_tensor = reduce_scatter_tensor
    try:
        model = fsdp(impl, LM(), compute_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        ids, targets = _batch(0, (5,), vocab=12)
        _loss(model(ids[:4]), targets[:4]).backward()
        model.finish_gradient_synchronization()
    finally:
        dist.reduce_scatter_tensor = original
    return "" if seen and set(seen) == {torch.bfloat16} else f"gradients reduce-scattered in {sorted(map(str, set(seen)))}"


FSDP_ROWS = (uneven_shards, tied_weights, full_state_dict, reduce_dtype)


def run_rows(ctx: RankContext, rows: tuple) -> dict[str, dict[str, str]]:
    """Rank function: every row on both implementations; an exception is that row's finding."""
    found: dict[str, dict[str, str]] = {}
    for row in rows:
        for impl in IMPLS:
            try:
                finding = row(ctx, impl)
            except Exception as e:  # noqa: BLE001 - raised alike on every rank: the row's finding
                where = traceback.extract_tb(e.__traceback__)[-1]
                finding = f"{type(e).__name__} at {where.filename.split('/')[-1]}:{where.lineno}: {e}"
            found.setdefault(row.__name__, {})[impl] = finding.splitlines()[0] if finding else ""
    return found
