"""What a rank does in a test: train through the submission's adapters on the data it was sent.

A rank only reports: the parameters it holds after construction and after every step, the
collectives it issued (and whether backward was running), the bytes it keeps. It checks
nothing. The grader (checks.py) trains the single-process reference and compares, in a process
that never imported the submission, so nothing a submission patches (``torch.allclose``, say)
reaches the comparison. These functions run in a rank (ranks.py), beside the submission's code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from grading import models, probes
from grading.ranks import Rank
from grading.submission import load_adapter


def snapshot(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: p.detach().to("cpu", copy=True) for name, p in named.items()}


def parameters_of(model: nn.Module, wrapper: nn.Module) -> dict[str, torch.Tensor]:
    """The trained parameters by the model's own names: the model the suite built, when the
    wrapper trains its parameters in place (as wrappers do); else the wrapper's, less a prefix."""
    mine = dict(model.named_parameters())
    wrapped = {id(p) for p in wrapper.parameters()}
    if all(id(p) in wrapped for p in mine.values() if p.requires_grad):
        return mine
    return by_model_names(dict(wrapper.named_parameters()), mine)


def by_model_names(named: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """``named`` under the model's own ``names``: a wrapper may add a prefix (``module.up.weight``)."""
    out = {}
    for name in names:
        match = [k for k in named if k == name or k.endswith("." + name)]
        if match:
            out[name] = named[min(match, key=len)]
    return out


def _holders(root: object, name: str, exclude: set[int]) -> dict:
    held = probes.held_tensors(root, name, exclude)
    return {"bytes": sum(h.nbytes for h in held), "largest": [h.line() for h in held[:3]]}


def train_ddp(ctx: Rank, job: dict) -> dict:
    """Wrap the model (this rank's own initial weights), train on this rank's shards."""
    case = job["case"]
    probes.install_collective_log()
    get, after = load_adapter(case["get"]), load_adapter(case["after_backward"])
    start = load_adapter(case["train_batch_start"]) if case.get("train_batch_start") else None
    model = models.build(case["model"])
    model.load_state_dict(job["init"])
    kwargs = {} if case.get("bucket_size_mb") is None else {"bucket_size_mb": case["bucket_size_mb"]}
    ddp = get(model, **kwargs)
    params = [snapshot(parameters_of(model, ddp))]
    optimizer = models.make_optimizer(case["optimizer"], ddp.parameters())
    reductions, during = [], []
    for batch in job["batches"]:
        if start is not None:
            start(ddp, optimizer)
        optimizer.zero_grad()
        mark = len(probes.LOG.calls)
        loss = F.mse_loss(ddp(batch["x"]), batch["y"])
        probes.mark_backward_start()
        loss.backward()
        probes.LOG.in_backward = False
        after(ddp, optimizer)
        optimizer.step()
        reductions.append(probes.LOG.reductions(mark))
        during.append(probes.LOG.reductions_during_backward(mark))
        params.append(snapshot(parameters_of(model, ddp)))
    return {"params": params, "reductions": reductions, "during_backward": during}


def train_sharded_optimizer(ctx: Rank, job: dict) -> dict:
    """Every rank computes the whole batch's gradients; the sharded optimizer steps."""
    probes.install_collective_log()
    get = load_adapter("get_sharded_optimizer")
    model = models.build("equal", layers=job["case"]["layers"])
    model.load_state_dict(job["init"])
    cls, kwargs = models.optimizer_class(job["case"]["optimizer"])
    optimizer = get(model.parameters(), cls, **kwargs)
    params = [snapshot(dict(model.named_parameters()))]
    for batch in job["batches"]:
        optimizer.zero_grad()
        F.mse_loss(model(batch["x"]), batch["y"]).backward()
        optimizer.step()
        params.append(snapshot(dict(model.named_parameters())))
    held = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    return {"params": params, "state": _holders(optimizer, "optimizer", held)}


def train_fsdp(ctx: Rank, job: dict) -> dict:
    """Build the model from the submission's layers (one seed on every rank, as the public tests
    do), report its initial weights, then train through the FSDP adapters on this rank's shards."""
    get, after = load_adapter("get_fsdp"), load_adapter("fsdp_on_after_backward")
    gather = load_adapter("fsdp_gather_full_params")
    torch.manual_seed(job["seed"])
    model = models.student_lm(models.LMShape(**job["case"]["shape"]))
    init = snapshot(dict(model.named_parameters()))
    fsdp = get(model, compute_dtype=None)  # as the public tests call it
    optimizer = models.make_optimizer(job["case"]["optimizer"], fsdp.parameters())
    gathered = []
    for batch in job["batches"]:
        optimizer.zero_grad(set_to_none=True)
        logits = fsdp(batch["ids"])
        F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).backward()
        after(fsdp, optimizer)
        optimizer.step()
        full = gather(fsdp)
        if not isinstance(full, dict):
            raise TypeError(f"fsdp_gather_full_params returned a {type(full).__name__}, not a dict of tensors")
        gathered.append(snapshot({str(k): v for k, v in full.items() if isinstance(v, torch.Tensor)}))
    optimizer.zero_grad(set_to_none=True)
    grads = {p.grad.untyped_storage().data_ptr() for p in fsdp.parameters() if p.grad is not None}
    return {"init": init, "params": gathered, "resident": _holders(fsdp, "fsdp", grads)}
