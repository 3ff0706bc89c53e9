"""A practitioner's training script, as one writes it for torch's FSDP2 and DDP, run unchanged on
ours and on torch's, each beside one process on the global batch (tests/test_practitioner.py).

The script does what such scripts do with the parameters after sharding or wrapping: weight-decay
groups by ``p.dim() >= 2`` (nanoGPT's ``configure_optimizers``), a parameter count by
``p.numel()``, ``torch.nn.utils.clip_grad_norm_`` before the step, torch's ``fully_shard``
keywords (``mesh``, ``mp_policy``, ``reshard_after_forward``, ``offload_policy``), and no call
between ``backward()`` and ``optimizer.step()``. Only the import differs between the sides.
Beside it: the DDP wrappers built with torch's keywords (and refusing those they cannot honour),
an unused parameter under ``find_unused_parameters``, and torch's ``FSDPModule`` methods.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cs336_systems.ddp import AutoBucketedDDP, BucketedDDP, FlatDDP, NaiveDDP, PerParameterDDP
from cs336_systems.launch import RankContext

BATCH = 8  # rows per step, split evenly over 2 ranks
STEPS = 3
MAX_NORM = 0.05  # well below the gradient norms (about 0.5): every step is clipped
# Our wrappers by name; bucketed with a cap of about 200 bytes, so that its 12 gradients fill
# several buckets (the default 25 MB would make one).
DDP_WRAPPERS = {"naive": NaiveDDP, "flat": FlatDDP, "per-parameter": PerParameterDDP,
                "bucketed": lambda m: BucketedDDP(m, 0.0002), "auto": AutoBucketedDDP}
DDP_SIDES = (*DDP_WRAPPERS, "torch")
# torch's DistributedDataParallel keywords a script passes, each at a value ours honour with
# torch's meaning; the bucketed wrappers take torch's bucket keywords too.
TORCH_KEYWORDS = {"device_ids": None, "output_device": None, "dim": 0, "broadcast_buffers": True, "init_sync": True,
                  "find_unused_parameters": False, "check_reduction": False, "static_graph": False}
BUCKET_KEYWORDS = {"bucket_cap_mb": 0.0002, "gradient_as_bucket_view": True}
FSDP_SIDES = ("ours", "torch")


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    """2-D weights and 1-D biases and norm gains, with 5 rows in the head: uneven over 2 ranks."""

    def __init__(self, width: int = 6):
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 5, generator=g)


def train(model: nn.Module, rows: slice, whole: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """The script: decay groups by shape, clipping, SGD; what it saw and the weights per step.
    ``whole`` turns a parameter into its full value (a DTensor's ``full_tensor``) to record it."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=0.5, momentum=0.9)
    seen = {"decayed": len(decay), "numel": sum(p.numel() for p in model.parameters()), "norms": [], "history": []}
    for step in range(STEPS):
        x, y = batch(step)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        seen["norms"].append(float(whole(norm)))
        seen["history"].append({n.removeprefix("module."): whole(p).detach().clone()
                                for n, p in model.named_parameters()})
    return seen


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train_one_process() -> dict:
    torch.manual_seed(0)
    return train(Net(), slice(None), _whole)


def _fsdp_side(ctx: RankContext, side: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    if side == "ours":
        from cs336_systems.fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True, offload_policy=OffloadPolicy())
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return train(model, _rows(ctx), _whole)


def _wrap(side: str, module: nn.Module, keywords: dict | None) -> nn.Module:
    """``module`` in the DDP wrapper ``side`` names, built with torch's ``keywords`` (None: none)."""
    if keywords is None:
        return DDP_WRAPPERS[side](module) if side != "torch" else _torch_ddp(module)
    wrappers = {"naive": NaiveDDP, "flat": FlatDDP, "per-parameter": PerParameterDDP, "bucketed": BucketedDDP,
                "auto": AutoBucketedDDP, "torch": _torch_ddp}
    extra = BUCKET_KEYWORDS if side in ("bucketed", "torch") else {}
    return wrappers[side](module, **keywords, **extra)


def _torch_ddp(module: nn.Module, **keywords) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, **keywords)


def fsdp_module_methods_side(ctx: RankContext, side: str) -> list[dict]:
    """The script's model trained with torch's ``FSDPModule`` methods called as a torch user calls
    them: explicit prefetch lists, the root resharded after forward, one block kept gathered
    after forward, an explicit async unshard of the root, and each step two micro-batches, the
    first without gradient sync, last backward or resharding after backward (its weights stay
    gathered for the second), ``reshard()`` on every module before the step. The full weights
    after each step."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from cs336_systems.fsdp import fully_shard

    shard = fully_shard if side == "ours" else torch_fully_shard
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        shard(block)
    shard(model)
    first, second = model.blocks
    first.set_modules_to_forward_prefetch([second])
    second.set_modules_to_backward_prefetch([first])
    model.set_reshard_after_forward(True, recurse=False)
    second.set_reshard_after_forward(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    rows, history = _rows(ctx), []
    half = (rows.stop - rows.start) // 2
    micro = (slice(rows.start, rows.start + half), slice(rows.start + half, rows.stop))
    for step in range(STEPS):
        x, y = batch(step)
        for i, part in enumerate(micro):
            last = i == len(micro) - 1
            model.set_requires_gradient_sync(last)
            model.set_is_last_backward(last)
            model.set_reshard_after_backward(last)
            model.unshard(async_op=True).wait()
            F.mse_loss(model(x[part]), y[part]).backward()
        for module in (model, *model.blocks):
            module.reshard()
        optimizer.step()
        optimizer.zero_grad()
        history.append({n: _whole(p).detach().clone() for n, p in model.named_parameters()})
    return history


def _ddp_side(ctx: RankContext, side: str, keywords: dict | None = None) -> dict:
    torch.manual_seed(0)
    return train(_wrap(side, Net(), keywords), _rows(ctx), _whole)


class WithSpareHead(Net):
    """Net with a head its forward never calls: a parameter no rank uses."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(6, 5)


def unused_parameter_outcome(ctx: RankContext, side: str, find_unused_parameters: bool) -> str:
    """Two steps of the script on a model with an unused head: what the second forward said
    ("trained" if nothing was raised)."""
    torch.manual_seed(0)
    model = _wrap(side, WithSpareHead(), {"find_unused_parameters": find_unused_parameters})
    try:
        for step in range(2):
            x, y = batch(step)
            F.mse_loss(model(x[_rows(ctx)]), y[_rows(ctx)]).backward()
    except RuntimeError as e:
        return str(e)
    return "trained"


def _rows(ctx: RankContext) -> slice:
    shard = BATCH // ctx.world_size
    return slice(ctx.rank * shard, (ctx.rank + 1) * shard)


# torch DDP keywords ours refuse, each with the words its one-line refusal must hold.
REFUSED_KEYWORDS = (({"mixed_precision": object()}, "mixed_precision="), ({"device_ids": [5]}, "device_ids=[5]"),
                    ({"dim": 1}, "dim=1"), ({"no_such_keyword": 1}, "unexpected keyword argument 'no_such_keyword'"))


def keyword_refusals(side: str) -> list[tuple[str, str]]:
    """What wrapper ``side`` raises for each of REFUSED_KEYWORDS (before any collective), and
    for ``bucket_cap_mb`` where it has no buckets: (exception type, message)."""
    cases = [kw for kw, _ in REFUSED_KEYWORDS] + ([] if side in ("bucketed", "auto") else [{"bucket_cap_mb": 10}])
    said = []
    for keywords in cases:
        try:
            _wrap(side, Net(), keywords)
            said.append(("accepted", ""))
        except (TypeError, ValueError) as e:
            said.append((type(e).__name__, str(e)))
    return said


def run_practitioner_sides(ctx: RankContext) -> dict[str, dict]:
    """Rank function: the script on every FSDP and DDP side, one after another."""
    results = {f"fsdp-{side}": _fsdp_side(ctx, side) for side in FSDP_SIDES}
    results["fsdp-methods"] = {side: fsdp_module_methods_side(ctx, side) for side in FSDP_SIDES}
    results.update({f"ddp-{side}": _ddp_side(ctx, side) for side in DDP_SIDES})
    results.update({f"ddp-{side}-torch-keywords": _ddp_side(ctx, side, TORCH_KEYWORDS) for side in DDP_SIDES})
    results["refusals"] = {side: keyword_refusals(side) for side in DDP_WRAPPERS}
    results["unused"] = {(side, flag): unused_parameter_outcome(ctx, side, flag)
                         for side in DDP_SIDES for flag in (False, True)}
    return results
