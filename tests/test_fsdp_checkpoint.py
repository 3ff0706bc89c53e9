"""Checkpoints of our FSDP with torch's own tools, each beside torch's ``fully_shard`` doing the same.

Written as a held-out check would be: the ranks reach our FSDP only through ``adapters.get_fsdp``
and checkpoint only through public torch APIs (``torch.distributed.checkpoint`` and its
``state_dict`` helpers), on ``fsdp.module`` as on ``fully_shard``'s model. Two jobs: world size 3
trains FIRST steps of AdamW on the tied model of tests/fsdp_cases.py, saves a sharded checkpoint
(model and optimizer) with DCP, exports a full state dict, trains on (the uninterrupted run), and
resumes a fresh model from its checkpoint; world size 2 does the same with its own folder and also
resumes from world size 3's checkpoints, ours and torch's, into ours and torch's. Each job also
loads a plain model's full state dict, from every rank and broadcast from rank 0. To spawn (and
import torch) once, the world-size-2 job runs in ranks 0 and 1 of the same spawn, in a new process
group made after the first is destroyed; its models, optimizers and group are new, so what it
resumes comes from the checkpoint folder alone.

Tolerances. A resume at the same world size repeats the same arithmetic: bitwise. Ours against
``fully_shard``, and a world size against another, sum the per-rank gradients in different orders
(tests/test_fsdp_ours.py, float32_tolerance); over four AdamW steps of lr 1e-2 they differed by at
most 1.2e-7 here (an ulp or two of weights up to 2.7), against every other run and single-process
training alike, so atol 1e-5.
A lost optimizer state shows up far above it: AdamW's first step after a reset moves every weight
by about lr = 1e-2, as does a checkpoint loaded into the wrong rows.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import adapters
from cs336_systems.launch import RankContext, launch, teardown
from tests.fsdp_cases import BATCH, Case, batch, build_model, loss_of, make_optimizer, train_reference

pytestmark = [pytest.mark.problem("beyond"), pytest.mark.timeout(400)]

FIRST, TOTAL = 2, 4  # steps before the checkpoint, steps in all
CASE = Case("adamw-fp32", "adamw", steps=TOTAL)
IMPLS = ("ours", "torch")
ATOL = 1e-5
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole weights, on rank 0


class Run:
    """One FSDP of either kind over the tied model, with its AdamW: what the checks drive.

    ``mesh``: hybrid sharding on this 2-D ("replicate", "shard") mesh (tests/
    test_fsdp_checkpoint_hybrid.py), given to ours as ``device_mesh`` or, with ``groups``, as
    its ``shard_group`` and ``replicate_group``; fully_shard takes the mesh.
    """

    def __init__(self, impl: str, ctx: RankContext, seed: int = 0, mesh=None, groups: bool = False):
        module = build_model(Case("init", "adamw", seed=seed), rank=0)  # every rank alike
        self.impl, self.ctx = impl, ctx
        if impl == "ours":
            self.runner = adapters.get_fsdp(module) if mesh is None else _hybrid_ours(module, mesh, groups)
            self.model = self.runner.module  # the model whose parameters are the shards
        else:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            mesh = mesh or DeviceMesh.from_group(dist.group.WORLD, "cpu")
            self.runner = self.model = fully_shard(module, mesh=mesh)
        self.optimizer = make_optimizer("adamw", self.runner.parameters())

    def train(self, steps: range) -> None:
        share = BATCH // self.ctx.world_size
        rows = slice(self.ctx.rank * share, (self.ctx.rank + 1) * share)
        for step in steps:
            self.optimizer.zero_grad(set_to_none=True)
            tokens, targets = batch(CASE, step)
            loss_of(self.runner(tokens[rows]), targets[rows]).backward()
            if self.impl == "ours":
                adapters.fsdp_on_after_backward(self.runner, self.optimizer)
            self.optimizer.step()

    def sharded_state(self) -> dict:
        return {"model": get_model_state_dict(self.model),
                "optim": get_optimizer_state_dict(self.model, self.optimizer)}

    def save(self, folder: Path) -> None:
        dcp.save(self.sharded_state(), checkpoint_id=folder)

    def load(self, folder: Path) -> None:
        state = self.sharded_state()  # the layout to read into: this job's own
        dcp.load(state, checkpoint_id=folder)
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])

    def full(self) -> dict[str, torch.Tensor]:
        """Every weight whole (rank 0; an empty dict elsewhere), copied: replicated parameters
        are plain tensors, which torch's helpers return as they are (the live parameter on CPU),
        as for any unsharded model."""
        return {k: v.clone() for k, v in get_model_state_dict(self.model, options=FULL).items()}

    def full_optimizer(self) -> dict:
        state = get_optimizer_state_dict(self.model, self.optimizer, options=FULL)
        return copy.deepcopy(state)


def _hybrid_ours(module: torch.nn.Module, mesh, groups: bool) -> torch.nn.Module:
    """Ours under hybrid sharding (an option adapters.get_fsdp does not set)."""
    from cs336_systems.fsdp import FullyShardedDataParallel

    if groups:
        return FullyShardedDataParallel(module, shard_group=mesh.get_group("shard"),
                                        replicate_group=mesh.get_group("replicate"))
    return FullyShardedDataParallel(module, device_mesh=mesh)


def _plain_load(impl: str, ctx: RankContext, broadcast: bool, **run_options) -> dict[str, torch.Tensor]:
    """A plain model's state dict loaded into a FSDP of another initialisation, exported back."""
    plain = build_model(Case("plain", "adamw", seed=7), rank=0).state_dict()
    run = Run(impl, ctx, **run_options)
    if broadcast:  # rank 0 alone holds it, as after torch.load on rank 0
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(run.model, plain if ctx.rank == 0 else {}, options=options)
    else:
        set_model_state_dict(run.model, plain, options=StateDictOptions(full_state_dict=True))
    return run.full()


def run_job(ctx: RankContext, folder: str, earlier: str | None) -> dict:
    """Rank function: save, export, continue and resume at this world size, for both FSDPs; with
    ``earlier`` (another world size's folder), resume from its checkpoints too."""
    out: dict = {}
    for impl in IMPLS:
        run = Run(impl, ctx)
        run.train(range(FIRST))
        run.save(Path(folder) / impl)
        out[impl] = {"exported": run.full(), "optimizer": run.full_optimizer()}
        run.train(range(FIRST, TOTAL))
        out[impl]["uninterrupted"] = run.full()
        resumed = Run(impl, ctx, seed=3)  # another start: the checkpoint must replace all of it
        resumed.load(Path(folder) / impl)
        resumed.train(range(FIRST, TOTAL))
        out[impl]["resumed"] = resumed.full()
        for source in IMPLS if earlier else ():
            other = Run(impl, ctx, seed=4)
            other.load(Path(earlier) / source)
            other.train(range(FIRST, TOTAL))
            out[impl][f"resumed from {source}"] = other.full()
        if impl == "ours":  # a rank's flat shard is not a checkpoint: refused, naming the weight
            try:
                run.model.load_state_dict({"up.weight": torch.zeros(3)}, strict=False)
            except ValueError as e:
                out["refused"] = str(e)
        out[impl]["plain"] = _plain_load(impl, ctx, broadcast=False)
        out[impl]["plain broadcast"] = _plain_load(impl, ctx, broadcast=True)
    return out


def _assert_same(actual: dict, expected: dict, what: str, atol: float = ATOL) -> None:
    assert actual.keys() == expected.keys(), f"{what}: keys {sorted(actual)} != {sorted(expected)}"
    for name, value in expected.items():
        assert type(actual[name]) is torch.Tensor, f"{what}, {name}: {type(actual[name]).__name__}"
        torch.testing.assert_close(actual[name], value, atol=atol, rtol=0.0,
                                   msg=lambda m: f"{what}, {name}: {m}")


def _check_full_state_dict(job: dict, where: str) -> None:
    """The export is the plain model's state dict (tied weight under both names), as
    fully_shard exports it and as single-process training reaches it; a plain model loads it."""
    reference = train_reference(CASE)
    plain_keys = build_model(CASE, rank=0).state_dict().keys()
    for moment, step in (("exported", FIRST - 1), ("uninterrupted", TOTAL - 1)):
        expected = {name: reference[step][name] for name in plain_keys if name != "lm_head.weight"}
        expected["lm_head.weight"] = reference[step]["embedding.weight"]
        for impl in IMPLS:
            _assert_same(job[impl][moment], expected, f"{where}: {impl} {moment} vs single process")
        _assert_same(job["ours"][moment], job["torch"][moment], f"{where}: {moment}, ours vs fully_shard")
    model = build_model(Case("load", "adamw", seed=5), rank=0)
    model.load_state_dict(job["ours"]["exported"])
    _assert_same(model.state_dict(), job["ours"]["exported"], f"{where}: plain model", atol=0.0)


def _check_full_optimizer_state_dict(job: dict, where: str) -> None:
    ours, torchs = job["ours"]["optimizer"], job["torch"]["optimizer"]
    assert ours["param_groups"] == torchs["param_groups"], where
    assert ours["state"].keys() == torchs["state"].keys(), where
    for name, state in torchs["state"].items():
        _assert_same(ours["state"][name], state, f"{where}: AdamW state of {name}")


def _check_plain_model_loads(job: dict, where: str) -> None:
    plain = build_model(Case("plain", "adamw", seed=7), rank=0).state_dict()
    for impl in IMPLS:
        for how in ("plain", "plain broadcast"):
            _assert_same(job[impl][how], plain, f"{where}: {impl}, {how}", atol=0.0)


def _check_flat_shard_refused(job: dict, where: str) -> None:
    message = job.get("refused", "")
    assert "up.weight" in message and "(3,)" in message and "(10, 8)" in message, f"{where}: {message}"
    assert "\n" not in message


def run_both_jobs(ctx: RankContext, root: str) -> dict[int, dict]:
    """Rank function (3 ranks): the world-size-3 job, then the world-size-2 job in a new group."""
    done = {3: run_job(ctx, f"{root}/ws3", None)}
    teardown()  # every rank done with the 3-rank group, which is destroyed
    if ctx.rank >= 2:
        return done
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous-ws2", rank=ctx.rank,
                            world_size=2, timeout=timedelta(seconds=120))
    done[2] = run_job(replace(ctx, world_size=2, local_world_size=2), f"{root}/ws2", f"{root}/ws3")
    return done


def test_checkpoints_with_torch_tools_as_fully_shard(tmp_path: Path):
    """One test: each check below needs the world-size-3 job's checkpoint or results."""
    done = launch(run_both_jobs, 3, args=(str(tmp_path),), timeout_s=120)[0]
    for world_size, job in done.items():
        where = f"world size {world_size}"
        _check_full_state_dict(job, where)
        _check_full_optimizer_state_dict(job, where)
        _check_plain_model_loads(job, where)
        _check_flat_shard_refused(job, where)
        for impl in IMPLS:  # the same arithmetic as the uninterrupted run: bitwise
            resumed = job[impl]["resumed"]
            _assert_same(resumed, job[impl]["uninterrupted"], f"{where}: {impl} resumed", atol=0.0)
    # Saved at 3 ranks by ours and by fully_shard, each loaded at 2 ranks into both.
    for impl in IMPLS:
        for source in IMPLS:
            resumed = done[2][impl][f"resumed from {source}"]
            what = f"{source}'s checkpoint at 3 into {impl} at 2"
            _assert_same(resumed, done[3]["ours"]["uninterrupted"], f"{what} vs ours uninterrupted at 3")
            _assert_same(resumed, done[3][source]["uninterrupted"], f"{what} vs {source} uninterrupted at 3")
            _assert_same(resumed, done[2]["torch"][f"resumed from {source}"], f"{what} vs fully_shard's")
