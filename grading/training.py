"""What a rank does in a test: train through the submission's adapters on the data it was sent.

A rank only reports: the parameters it holds after construction and after every step, the
collectives it issued (whether backward was running, the bytes each carried, whether it was
left pending), the bytes it keeps. It checks nothing. Initial weights and data come from the
grader, never from the submission. The grader (checks.py) trains the single-process reference and compares, in a process
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
    """Wrap the model (this rank's own initial weights), train on this rank's shards. Per step:
    each reduction as [bytes, issued during backward, left pending until backward was done]."""
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
    reductions = []
    for batch in job["batches"]:
        if start is not None:
            start(ddp, optimizer)
        optimizer.zero_grad()
        mark = len(probes.LOG.calls)
        loss = F.mse_loss(ddp(batch["x"]), batch["y"])
        with probes.backward_running():
            loss.backward()
        after(ddp, optimizer)
        optimizer.step()
        reductions.append([[c.nbytes, c.during_backward, c.overlapping] for c in probes.LOG.reductions(mark)])
        params.append(snapshot(parameters_of(model, ddp)))
    return {"params": params, "reductions": reductions}


def _storages(*roots: object) -> set[int]:
    return {ptr for root in roots for ptr in probes.reachable_storages(root)}


def train_sharded_optimizer(ctx: Rank, job: dict) -> dict:
    """Every rank computes the whole batch's gradients; the sharded optimizer steps. Parameter
    groups, and a group added after a step, as the case says (models.zero_groups). The state:
    every tensor made since the rank started but the model's, its gradients and the snapshots."""
    case = job["case"]
    if case["measure_state"]:
        probes.count_from_here()  # before any of the submission's code: torch's and the grader's objects are not counted
    probes.install_collective_log()
    get = load_adapter("get_sharded_optimizer")
    model = models.build("equal", layers=case["layers"])
    model.load_state_dict(job["init"])
    cls, kwargs = models.optimizer_class(case["optimizer"])
    optimizer = get(models.zero_groups(model, case), cls, **kwargs)
    params = [snapshot(dict(model.named_parameters()))]
    for step, batch in enumerate(job["batches"], 1):
        optimizer.zero_grad()
        F.mse_loss(model(batch["x"]), batch["y"]).backward()
        optimizer.step()
        params.append(snapshot(dict(model.named_parameters())))
        if (added := models.added_group(model, case, step)) is not None:
            optimizer.add_param_group(added)
    if not case["measure_state"]:
        return {"params": params}
    exclude = _storages(params, model)
    exclude |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    held = probes.live_tensors(exclude, {"optimizer": optimizer})
    return {"params": params, "state": {"bytes": sum(h.nbytes for h in held), "largest": [h.line() for h in held[:3]]}}


def train_fsdp(ctx: Rank, job: dict) -> dict:
    """Build the model from the submission's layers, fill it with the grader's initial weights
    (models.fill_lm), report where each went, then train through the FSDP adapters on this
    rank's shards with ``compute_dtype`` as the case says."""
    get, after = load_adapter("get_fsdp"), load_adapter("fsdp_on_after_backward")
    gather = load_adapter("fsdp_gather_full_params")
    case = job["case"]
    model = models.student_lm(models.LMShape(**case["shape"]))
    layout = models.fill_lm(model, job["init"])
    dtype = getattr(torch, case["compute_dtype"]) if case.get("compute_dtype") else None
    fsdp = get(model, compute_dtype=dtype)
    optimizer = models.make_optimizer(case["optimizer"], fsdp.parameters())
    gathered, masters, output = [], {}, ""
    for batch in job["batches"]:
        optimizer.zero_grad(set_to_none=True)
        logits = fsdp(batch["ids"])
        output = output or str(logits.dtype)
        F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten()).backward()
        after(fsdp, optimizer)
        masters = masters or {n: [str(p.dtype), str(p.grad.dtype) if p.grad is not None else ""]
                              for n, p in fsdp.named_parameters()}
        optimizer.step()
        full = gather(fsdp)
        if not isinstance(full, dict):
            raise TypeError(f"fsdp_gather_full_params returned a {type(full).__name__}, not a dict of tensors")
        gathered.append(snapshot({str(k): v for k, v in full.items() if isinstance(v, torch.Tensor)}))
    optimizer.zero_grad(set_to_none=True)
    grads = {p.grad.untyped_storage().data_ptr() for p in fsdp.parameters() if p.grad is not None}
    return {"layout": layout, "params": gathered, "masters": masters, "output": output,
            "resident": _holders(fsdp, "fsdp", grads)}
