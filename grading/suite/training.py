"""What a rank does in a test: train through the submission's adapters on the data it was sent.

A rank only reports: the parameters it holds after construction and after every step, the
collectives it issued (whether backward was running, the bytes each carried, whether it was
left pending), the bytes it keeps. It checks nothing. Initial weights and data come from the
grader, never from the submission. The grader (checks.py) trains the single-process reference and compares, in a process
that never imported the submission, so nothing a submission patches (``torch.allclose``, say)
reaches the comparison. These functions run in a rank (ranks.py), beside the submission's code.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from grading.suite import models
from grading.readings import outside, probes, traffic
from grading.isolation import wire
from grading.isolation.ranks import Rank
from grading.intake.submission import load_adapter


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


def sampled(named: dict[str, torch.Tensor], sample: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """A snapshot, or with ``sample`` only some values of each large tensor: a model sized to be
    seen in a rank's memory is too large to send back whole after every step. ``sample`` maps a
    parameter name, or the first part of one (an FSDP model's layer: the submission names its
    weight), to flat indices the grader drew; a tensor with fewer elements than the largest
    index is kept whole (a bias, a norm's gain)."""
    if sample is None:
        return snapshot(named)
    out = {}
    for name, p in named.items():
        idx = sample.get(name, sample.get(name.split(".")[0]))
        flat = p.detach().to("cpu").reshape(-1)
        out[name] = flat[idx].clone() if idx is not None and flat.numel() > int(idx.max()) else flat.clone().view(p.shape)
    return out


def inside(root: object, name: str, exclude: set[int]) -> dict:
    """What ``root`` reaches, counted inside the rank: its three largest tensors and buffers
    (``hint``) and the bytes of every tensor storage and buffer it reaches, the attributes of the
    submission's classes included (``inside``). A witness beside the grader's reading from
    outside, never a basis of points alone: the submission's code could hide or fake them
    (memory.judged holds a problem for review where the two disagree)."""
    found = probes.held_tensors(root, name, exclude, frozenset(submission_modules()))
    return {"hint": [h.line() for h in found[:3]], "inside": sum(h.nbytes for h in found)}


def submission_modules() -> dict[str, dict]:
    """The submission's own imported modules (their files under its folders, or in the packages
    installed for it, which each rank imports itself: grading/isolation/preload.py): name -> globals."""
    from grading.isolation.ranks import submission_roots

    layer = os.environ.get("GRADING_SUBMISSION_PACKAGES")
    roots = [os.path.realpath(r) + os.sep for r in [*submission_roots(), *([layer] if layer else [])]]
    return {name: vars(module) for name, module in list(sys.modules.items())
            if isinstance(getattr(module, "__file__", None), str)
            and any(os.path.realpath(module.__file__).startswith(r) for r in roots)}


IMPORT_DIGESTS = 1 << 20  # tensors and buffers of this size or more made at import are followed by digest


def imported_tensors() -> dict:
    """The tensors and byte buffers the submission's modules hold once imported (their globals,
    their classes' attributes, and what those reach), counted inside the rank, with a digest of
    each of at least ``IMPORT_DIGESTS``: memory made before the grader's baseline is not read from
    outside (memory.py), so one that is written to later (``imported_since``) is a place to keep
    state the readings cannot see, a witness for review; one that stays as made (a constant
    causal mask) is not (``imported``: bytes, and the largest's path)."""
    mine = submission_modules()
    found = probes.held_tensors(mine, "modules", classes_of=frozenset(mine), digests=IMPORT_DIGESTS)
    return {"imported": sum(h.nbytes for h in found), "imported_largest": found[0].line() if found else "",
            "imported_digests": {h.path: h.digest for h in found if h.digest}}


def imported_since(imported: dict) -> dict:
    """What became of the large tensors and buffers the submission's modules held once imported:
    the paths of those whose bytes have changed since, or that are gone (``imported_changed``)."""
    if not imported.get("imported_digests"):
        return {}
    now = {h.path: h.digest for h in probes.held_tensors(submission_modules(), "modules",
                                                           classes_of=frozenset(submission_modules()),
                                                           digests=IMPORT_DIGESTS)}
    changed = [path for path, digest in imported["imported_digests"].items() if now.get(path) != digest]
    return {"imported_changed": changed[:3]}


def drop_gradients(params) -> None:
    """The suite's own: before a pause, no gradient stays, whatever the submission's zero_grad does."""
    for p in params:
        p.grad = None


def train_ddp(ctx: Rank, job: dict) -> dict:
    """Wrap the model (this rank's own initial weights), train on this rank's shards. Per step:
    each reduction as [bytes, issued during backward, left pending until backward was done]."""
    case = job["case"]
    probes.install_collective_log()
    get, after = load_adapter(case["get"]), load_adapter(case["after_backward"])
    start = load_adapter(case["train_batch_start"]) if case.get("train_batch_start") else None
    ctx.arm()  # imported: what its code does from here on is witnessed (review.witness)
    model = models.build(case["model"])
    model.load_state_dict(job["init"])
    kwargs = {} if case.get("bucket_size_mb") is None else {"bucket_size_mb": case["bucket_size_mb"]}
    ddp = get(model, **kwargs)
    params = [snapshot(parameters_of(model, ddp))]
    optimizer = models.make_optimizer(case["optimizer"], ddp.parameters())
    reductions = []
    gate = _Gate(ctx, case["traffic"]) if case.get("traffic") else None
    for step, batch in enumerate(job["batches"], 1):
        if start is not None:
            start(ddp, optimizer)
        optimizer.zero_grad()
        if gate is not None:
            batch = gate.before_forward(step) or batch
        mark = len(probes.LOG.calls)
        loss = F.mse_loss(ddp(batch["x"]), batch["y"])
        with probes.backward_running():
            loss.backward()
        after(ddp, optimizer)
        if gate is not None:
            ctx.hold(f"after backward of step {step}")
        optimizer.step()
        reductions.append([[c.nbytes, c.during_backward, c.overlapping] for c in probes.LOG.reductions(mark)])
        params.append(snapshot(parameters_of(model, ddp)))
    return {"params": params, "reductions": reductions}


def released_batch(sent: bytes) -> dict | None:
    """A batch the grader sent with a hold's release (traffic.py), or None where it sent none: a
    step whose data arrive only then cannot start before the grader has read the loopback."""
    if not sent:
        return None
    batch = wire.decode(sent)
    if not isinstance(batch, dict):
        raise RuntimeError("the grader's release carried no batch")
    return batch


class _Gate:
    """The overlap test's holds (grading/readings/traffic.py): before forward, when backward reaches the
    probe (the first layer's backward still to run), and after the backward's synchronisation.
    At the probe of every judged step (from step 2: a bucketed wrapper may build its buckets in
    step 1, carried.ddp_finding) the rank first waits, at most ``WAIT_S``, until the loopback has
    carried what the grader expects of the layers above it (``expected["above"]`` bytes, from its
    calibration: the check's pass mark, never more), or until every collective the rank issued
    since forward has finished (no byte of its is still on its way). Asynchronous all-reduces run
    on gloo's thread, and get the time they need; a wrapper that sent nothing during backward
    costs no wait. The wait only decides when to hold; the grader judges the bytes it reads itself,
    with every rank stopped. A wait that ran out never stops the next step's: a wrapper that asked
    for its last bucket late in one step (75% of the bytes, past a pass mark of 70%, but under the
    80% the wait once asked for) was read mid-flight in every later step, and capped."""

    WAIT_S = 10.0

    def __init__(self, ctx: Rank, expected: dict):
        self.ctx, self.above, self.step, self.start = ctx, expected["above"], 0, 0
        probes.LOG.at_probe = self.at_probe

    def before_forward(self, step: int) -> dict | None:
        """The step's batch, which the grader sends when it lets the group go (None: the job's)."""
        self.step = step
        sent = self.ctx.hold(f"before forward of step {step}")
        self.start = traffic.loopback_bytes() or 0
        probes.LOG.pending = []  # the work handles of this step's collectives, until the probe
        return released_batch(sent)

    def at_probe(self) -> None:
        deadline = time.monotonic() + (self.WAIT_S if self.step > 1 else 0)
        while (traffic.loopback_bytes() or 0) - self.start < self.above and time.monotonic() < deadline \
                and not all(_finished(w) for w in probes.LOG.pending):
            time.sleep(0.002)
        probes.LOG.pending = None  # the handles go: they hold the wrapper's buffers
        self.ctx.hold(f"backward reached the first layer of step {self.step}")


def _finished(work) -> bool:
    """Whether a collective's work is done (gloo's handles say so); one that cannot say is not."""
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a handle of another kind: waited for until the deadline
        return False


def train_sharded_optimizer(ctx: Rank, job: dict) -> dict:
    """Every rank computes the whole batch's gradients; the sharded optimizer steps. Parameter
    groups, and a group added after a step, as the case says (models.zero_groups). With
    ``measure_state``, the rank pauses for the grader to read its memory from outside
    (grading/readings/outside.py): once before any of the submission's code runs, and after every step
    with no gradient left."""
    case, sample = job["case"], job.get("sample")
    measure = case["measure_state"]
    if measure:
        ctx.pause(outside.BEFORE)
    probes.install_collective_log()
    get = load_adapter("get_sharded_optimizer")
    if measure:
        torch.set_num_threads(1)  # the grader's, whatever the submission set at import (more threads, more memory)
        imported = imported_tensors()
        ctx.pause(outside.IMPORTED)
    model = models.build("equal", layers=case["layers"], width=case["width"])
    model.load_state_dict(job["init"])
    cls, kwargs = models.optimizer_class(case["optimizer"])
    optimizer = get(models.zero_groups(model, case), cls, **kwargs)
    params = [sampled(dict(model.named_parameters()), sample)]
    for step, batch in enumerate(job["batches"], 1):
        optimizer.zero_grad()
        F.mse_loss(model(batch["x"]), batch["y"]).backward()
        optimizer.step()
        params.append(sampled(dict(model.named_parameters()), sample))
        if measure:
            drop_gradients(model.parameters())
            ctx.pause(f"after step {step}")
        if (added := models.added_group(model, case, step)) is not None:
            optimizer.add_param_group(added)
    if not measure:
        return {"params": params}
    return {"params": params, **imported, **imported_since(imported),
            **inside(optimizer, "optimizer", {p.untyped_storage().data_ptr() for p in model.parameters()})}



def import_model_module() -> None:
    """The submission's ``cs336_basics.model``, imported before a measured rank's pause after its
    import: the course's own model module imports einx, einops and jaxtyping (about 5 MB), which
    are no part of what the rank stores. One that fails to import fails where the model is built,
    with its own reason."""
    try:
        importlib.import_module("cs336_basics.model")
    except Exception:  # noqa: BLE001 - models.student_lm raises it again, as the rank's reason
        pass


def train_fsdp(ctx: Rank, job: dict) -> dict:
    """Build the model from the submission's layers, fill it with the grader's initial weights
    (models.fill_lm), report where each went, then train through the FSDP adapters on this
    rank's shards with ``compute_dtype`` as the case says. With ``measure``, the rank pauses for
    the grader to read its memory from outside (grading/readings/outside.py): before any of the
    submission's code runs, between forward and backward, and after every step with no gradient
    left (before the full parameters are gathered for the grader). With ``traffic``, every rank
    holds for the grader to read the loopback's bytes (grading/readings/traffic.py) before forward,
    between forward and backward, and after ``fsdp_on_after_backward`` of every step."""
    case, sample = job["case"], job.get("sample")
    measure, carried = case.get("measure", False), case.get("traffic", False)
    if measure:
        ctx.pause(outside.BEFORE)
    if carried:  # the rank's own record of its gathers' dtypes, beside the loopback's bytes (carried.py)
        probes.install_collective_log()
    get, after = load_adapter("get_fsdp"), load_adapter("fsdp_on_after_backward")
    gather = load_adapter("fsdp_gather_full_params")
    imported = {}
    if measure:
        import_model_module()
        torch.set_num_threads(1)  # the grader's, whatever the submission set at import (more threads, more memory)
        imported = imported_tensors()
        ctx.pause(outside.IMPORTED)
    shape = models.LMShape(**case["shape"])
    model = models.student_lm(shape, quick=measure)
    init = job.pop("init", None)
    if init is None:  # a measured run's: from the grader's seed, one layer at a time, none held at the pauses
        init = models.lm_init_by_layer(shape, torch.Generator().manual_seed(job["init_seed"]))
    layout = models.fill_lm(model, init)
    del init
    dtype = getattr(torch, case["compute_dtype"]) if case.get("compute_dtype") else None
    fsdp = get(model, compute_dtype=dtype)
    optimizer = models.make_optimizer(case["optimizer"], fsdp.parameters())
    gathered, masters, output, gathers = [], {}, "", []
    for step, batch in enumerate(job["batches"], 1):
        optimizer.zero_grad(set_to_none=True)
        if carried:
            batch = released_batch(ctx.hold(f"before forward of step {step}")) or batch
        mark = len(probes.LOG.calls)
        logits = fsdp(batch["ids"])
        forward_end = len(probes.LOG.calls)
        output = output or str(logits.dtype)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
        if measure:
            ctx.pause(f"between forward and backward of step {step}")
        if carried:
            ctx.hold(f"between forward and backward of step {step}")
        loss.backward()
        del loss, logits
        after(fsdp, optimizer)
        if carried:
            ctx.hold(f"after backward of step {step}")
            gathers.append([_gathers(probes.LOG.calls[mark:forward_end]), _gathers(probes.LOG.calls[forward_end:])])
        masters = masters or {n: [str(p.dtype), str(p.grad.dtype) if p.grad is not None else ""]
                              for n, p in fsdp.named_parameters()}
        optimizer.step()
        if measure:
            drop_gradients(list(fsdp.parameters()) + list(model.parameters()))
            ctx.pause(f"after step {step}")
        full = gather(fsdp)
        if not isinstance(full, dict):
            raise TypeError(f"fsdp_gather_full_params returned a {type(full).__name__}, not a dict of tensors")
        full = {str(k): v for k, v in full.items() if isinstance(v, torch.Tensor)}
        gathered.append(sampled(by_model_names(full, layout) if sample is not None else full, sample))
        del full
    optimizer.zero_grad(set_to_none=True)
    return {"layout": layout, "params": gathered, "masters": masters, "output": output, "gathers": gathers,
            **(inside(fsdp, "fsdp", set()) if measure else {"hint": []}),
            **({"inside_weights": weights_inside(fsdp, model)} if measure else {}), **imported, **imported_since(imported)}


def _gathers(calls: list) -> list[list]:
    """[bytes, dtype] of each all-gather among ``calls``, as the rank's own collective log saw it."""
    return [[c.nbytes, c.dtype] for c in calls if c.name in ("all_gather", "all_gather_into_tensor", "_all_gather_base")]


def weights_inside(fsdp, model: torch.nn.Module) -> int:
    """The bytes of what the rank's weights are, counted inside it: the storages of the FSDP's
    parameters (what its optimizer steps) and of every tensor the model's layers hold as an
    attribute (a full weight a layer keeps between steps among them). Not its communication
    buffers: a reduce-scatter's full gradient kept with its work handle until the next forward is
    no weight (memory.inside_weights: the reading from outside counts it; the two then disagree)."""
    storages: dict[int, int] = {}
    tensors = list(fsdp.parameters()) if hasattr(fsdp, "parameters") else []
    for module in model.modules():
        tensors += [v for v in (*module._parameters.values(), *module._buffers.values(), *vars(module).values())
                    if isinstance(v, torch.Tensor)]
    for t in tensors:
        if t.device.type != "meta":
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def calibrate_sharded_optimizer(ctx: Rank, job: dict) -> dict:
    """The grader's own training at a measured optimizer run's sizes and pauses, no submission code
    (the same model, weights and data; a plain SGD, which keeps no state): what a rank holds
    beyond any optimizer state (the model, autograd's and gloo's buffers, pages it touched),
    read as the measured ranks are, in the same run (memory.py subtracts it)."""
    case = job["case"]
    ctx.pause(outside.BEFORE)
    model = models.build("equal", layers=case["layers"], width=case["width"])
    model.load_state_dict(job["init"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, batch in enumerate(job["batches"], 1):
        optimizer.zero_grad()
        F.mse_loss(model(batch["x"]), batch["y"]).backward()
        optimizer.step()
        drop_gradients(model.parameters())
        ctx.pause(f"after step {step}")
    return {}


def calibrate_fsdp(ctx: Rank, job: dict) -> dict:
    """The grader's own plain model at a measured FSDP run's sizes and pauses, no submission code:
    every weight whole (models.ReferenceLM from the same seed), SGD as the measured run trains;
    what a rank keeps beyond its weights is what it holds after a step less the full model
    (memory.py)."""
    case = job["case"]
    ctx.pause(outside.BEFORE)
    shape = models.LMShape(**case["shape"])
    model = models.ReferenceLM(shape, models.lm_init(shape, torch.Generator().manual_seed(job["init_seed"])),
                               {name: list(dims) for name, dims in models.lm_layout(shape).items()})
    optimizer = models.make_optimizer(case["optimizer"], model.parameters())
    for step, batch in enumerate(job["batches"], 1):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(batch["ids"]).float().flatten(0, 1), batch["labels"].flatten())
        ctx.pause(f"between forward and backward of step {step}")
        loss.backward()
        del loss
        optimizer.step()
        drop_gradients(model.parameters())
        ctx.pause(f"after step {step}")
    return {}


outside.freeze_in_fork_server()  # the fork server's last preload: see there
