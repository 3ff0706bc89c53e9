"""Checkpoints of our FSDP with torch's own tools, each beside torch's ``fully_shard`` doing the same.

Written as a held-out check would be: the ranks reach our FSDP only through ``adapters.get_fsdp``
and checkpoint only through public torch APIs (``torch.distributed.checkpoint`` and its
``state_dict`` helpers), on ``fsdp.module`` as on ``fully_shard``'s model. Two spawned jobs, whose
only link is the checkpoint folder: world size 3 trains FIRST steps of AdamW on the tied model of
tests/fsdp_cases.py, saves a sharded checkpoint (model and optimizer) with DCP, exports a full
state dict, trains on (the uninterrupted run), and resumes a fresh model from its checkpoint;
world size 2 does the same with its own folder and also resumes from world size 3's checkpoints,
ours and torch's, into ours and torch's. Each job also loads a plain model's full state dict,
from every rank and broadcast from rank 0.

Tolerances. A resume at the same world size repeats the same arithmetic: bitwise. Ours against
``fully_shard``, and a world size against another, sum the per-rank gradients in different orders
(tests/test_fsdp_ours.py, float32_tolerance): AdamW's normalised updates turn that into at most a
few ulps of the weights over four steps of lr 1e-2, so atol 1e-5 (weights are about 0.1 to 1 here).
A lost optimizer state shows up far above it: AdamW's first step after a reset moves every weight
by about lr = 1e-2, as does a checkpoint loaded into the wrong rows.
"""

from __future__ import annotations

import copy
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
from cs336_systems.launch import RankContext, launch
from tests.fsdp_cases import BATCH, Case, batch, build_model, loss_of, make_optimizer, train_reference

pytestmark = [pytest.mark.problem("beyond"), pytest.mark.timeout(300), pytest.mark.xdist_group("fsdp-checkpoint")]

FIRST, TOTAL = 2, 4  # steps before the checkpoint, steps in all
CASE = Case("adamw-fp32", "adamw", steps=TOTAL)
IMPLS = ("ours", "torch")
ATOL = 1e-5
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole weights, on rank 0


class Run:
    """One FSDP of either kind over the tied model, with its AdamW: what the checks drive."""

    def __init__(self, impl: str, ctx: RankContext, seed: int = 0):
        module = build_model(Case("init", "adamw", seed=seed), rank=0)  # every rank alike
        self.impl, self.ctx = impl, ctx
        if impl == "ours":
            self.runner = adapters.get_fsdp(module)
            self.model = self.runner.module  # the model whose parameters are the shards
        else:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            self.runner = self.model = fully_shard(module, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
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


def _plain_load(impl: str, ctx: RankContext, broadcast: bool) -> dict[str, torch.Tensor]:
    """A plain model's state dict loaded into a FSDP of another initialisation, exported back."""
    plain = build_model(Case("plain", "adamw", seed=7), rank=0).state_dict()
    run = Run(impl, ctx)
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
        out[impl]["plain"] = _plain_load(impl, ctx, broadcast=False)
        out[impl]["plain broadcast"] = _plain_load(impl, ctx, broadcast=True)
    return out


_jobs: dict[int, dict] = {}


def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """Rank 0's results of the world-size-3 job, then of the world-size-2 job that resumes it."""
    if not _jobs:
        root = tmp_path_factory.mktemp("fsdp-checkpoints")
        _jobs[3] = launch(run_job, 3, args=(str(root / "ws3"), None), timeout_s=120)[0]
        _jobs[2] = launch(run_job, 2, args=(str(root / "ws2"), str(root / "ws3")), timeout_s=120)[0]
    return _jobs


def _assert_same(actual: dict, expected: dict, what: str, atol: float = ATOL) -> None:
    assert actual.keys() == expected.keys(), f"{what}: keys {sorted(actual)} != {sorted(expected)}"
    for name, value in expected.items():
        assert type(actual[name]) is torch.Tensor, f"{what}, {name}: {type(actual[name]).__name__}"
        torch.testing.assert_close(actual[name], value, atol=atol, rtol=0.0,
                                   msg=lambda m: f"{what}, {name}: {m}")


@pytest.mark.parametrize("world_size", (2, 3))
def test_full_state_dict_is_the_plain_model_state_dict_as_fully_shard_exports_it(world_size, tmp_path_factory):
    job = jobs(tmp_path_factory)[world_size]
    reference = train_reference(CASE)
    plain_keys = build_model(CASE, rank=0).state_dict().keys()  # tied weight under both names
    for moment, step in (("exported", FIRST - 1), ("uninterrupted", TOTAL - 1)):
        expected = {name: reference[step][name] for name in plain_keys if name != "lm_head.weight"}
        expected["lm_head.weight"] = reference[step]["embedding.weight"]
        for impl in IMPLS:
            _assert_same(job[impl][moment], expected, f"{impl} {moment} vs single process")
        _assert_same(job["ours"][moment], job["torch"][moment], f"{moment}: ours vs fully_shard")
    # A plain model loads the export, and exports it back unchanged.
    model = build_model(Case("load", "adamw", seed=5), rank=0)
    model.load_state_dict(job["ours"]["exported"])
    _assert_same(model.state_dict(), job["ours"]["exported"], "plain model", atol=0.0)


@pytest.mark.parametrize("world_size", (2, 3))
def test_full_optimizer_state_dict_as_fully_shard_exports_it(world_size, tmp_path_factory):
    job = jobs(tmp_path_factory)[world_size]
    ours, torchs = job["ours"]["optimizer"], job["torch"]["optimizer"]
    assert ours["param_groups"] == torchs["param_groups"]
    assert ours["state"].keys() == torchs["state"].keys()
    for name, state in torchs["state"].items():
        _assert_same(ours["state"][name], state, f"AdamW state of {name}")


@pytest.mark.parametrize("world_size", (2, 3))
def test_full_state_dict_of_a_plain_model_loads_into_fsdp(world_size, tmp_path_factory):
    job = jobs(tmp_path_factory)[world_size]
    plain = build_model(Case("plain", "adamw", seed=7), rank=0).state_dict()
    for impl in IMPLS:
        for how in ("plain", "plain broadcast"):
            _assert_same(job[impl][how], plain, f"{impl}, {how}", atol=0.0)


@pytest.mark.parametrize("world_size", (2, 3))
def test_sharded_checkpoint_resumes_bitwise_at_the_same_world_size(world_size, tmp_path_factory):
    job = jobs(tmp_path_factory)[world_size]
    for impl in IMPLS:
        _assert_same(job[impl]["resumed"], job[impl]["uninterrupted"], f"{impl} resumed", atol=0.0)


def test_sharded_checkpoint_of_3_ranks_resumes_at_2_in_either_fsdp(tmp_path_factory):
    """Saved at 3 ranks by ours and by fully_shard, each loaded at 2 ranks into both."""
    done = jobs(tmp_path_factory)
    uninterrupted = done[3]["ours"]["uninterrupted"]
    for impl in IMPLS:
        for source in IMPLS:
            resumed = done[2][impl][f"resumed from {source}"]
            _assert_same(resumed, uninterrupted, f"{source}'s checkpoint at 3 ranks into {impl} at 2")
            _assert_same(resumed, done[3][source]["uninterrupted"], f"{source} at 3 vs {impl} resumed at 2")
