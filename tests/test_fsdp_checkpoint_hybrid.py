"""Checkpoints of our FSDP under hybrid sharding (HSDP), beside torch's ``fully_shard`` on the same
2-D mesh: 4 ranks as 2 replicas x 2 shards, ("replicate", "shard") mesh [[0, 1], [2, 3]].

One spawn of 4 ranks, as tests/test_fsdp_checkpoint.py's world-size-3 job but hybrid: ours (given
``device_mesh``), ours given the same mesh's ``shard_group`` and ``replicate_group`` (the form
without a mesh, whose 2-D mesh checkpoint.py builds from the groups) and ``fully_shard`` each train
FIRST steps of AdamW, save model and optimizer with DCP, export a full state dict and resume a fresh
model of another initialisation from their own checkpoint; ours and ``fully_shard`` also train on
(the uninterrupted run) and resume from each other's checkpoint. Then ranks 0 and 1 form a new
2-rank group and load ours' hybrid checkpoint into plain (non-hybrid) sharding, ours and
``fully_shard``, and train on.

What is checked, and to what tolerance (tests/test_fsdp_checkpoint.py says why 1e-5):
* the DTensors ours presents on every rank are ``fully_shard``'s: the same 2-D mesh, dimension
  names, placements ``(Replicate(), Shard(0))`` and local shape, for the weights and AdamW's
  moments;
* the full export (rank 0) equals ``fully_shard``'s and single-process training, atol 1e-5; the
  groups form's equals the mesh form's bitwise (the same collectives over the same groups);
* a resume at 4 ranks continues bitwise as the uninterrupted run (both forms): it repeats the
  same arithmetic on the same bits, the moments and AdamW's step count included;
* across ours and ``fully_shard`` at 4 ranks and into plain sharding at 2 ranks, atol 1e-5
  against the uninterrupted run and single-process training (the gradients are summed in another
  order); the optimizer state loaded at 2 ranks equals the one exported at 4 bitwise;
* a plain model's state dict, from every rank or broadcast from rank 0, loads exactly (both forms);
* groups that form no 2-D grid (replicate groups [0, 3] and [1, 2] across shard groups [0, 1] and
  [2, 3]) are refused when the wrapper is built, with one line, on every rank.

About 20 s on 2 cores (4 ranks); there is no heavier variant.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from cs336_systems.launch import RankContext, launch, teardown
from tests.fsdp_cases import Case, build_model, train_reference
from tests.test_fsdp_checkpoint import CASE, FIRST, TOTAL, Run, _assert_same, _plain_load

pytestmark = [pytest.mark.problem("beyond"), pytest.mark.timeout(400)]

SIDES = {"ours": ("ours", False), "ours-groups": ("ours", True), "torch": ("torch", False)}
SHARDED = ("embedding.weight", "up.weight", "down.weight", "lm_head.weight")  # ours shards these


def _layout(run: Run) -> dict[str, tuple]:
    """This rank's view of each sharded weight and its AdamW moments as the state-dict helpers
    present them: (mesh, dimension names, placements, local shape, global shape)."""
    def describe(value) -> tuple:
        assert isinstance(value, DTensor), type(value).__name__
        mesh = value.device_mesh
        return (mesh.mesh.tolist(), mesh.mesh_dim_names, tuple(map(str, value.placements)),
                tuple(value.to_local().shape), tuple(value.shape))

    model = get_model_state_dict(run.model)
    optim = get_optimizer_state_dict(run.model, run.optimizer)["state"]
    out = {name: describe(model[name]) for name in SHARDED}
    out.update({f"{name} {m}": describe(optim[name][m]) for name in SHARDED if name in optim
                for m in ("exp_avg", "exp_avg_sq")})
    return out


def _hybrid_job(ctx: RankContext, folder: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out: dict = {}
    for side, (impl, groups) in SIDES.items():
        run = Run(impl, ctx, mesh=mesh, groups=groups)
        run.train(range(FIRST))
        run.save(folder / side)
        out[side] = {"layout": _layout(run), "exported": run.full(), "optimizer": run.full_optimizer()}
        if side != "ours-groups":  # its uninterrupted run is the mesh form's, bit for bit
            run.train(range(FIRST, TOTAL))
            out[side]["uninterrupted"] = run.full()
        resumed = Run(impl, ctx, seed=3, mesh=mesh, groups=groups)
        resumed.load(folder / side)
        resumed.train(range(FIRST, TOTAL))
        out[side]["resumed"] = resumed.full()
        for how, broadcast in (("plain", False), ("plain broadcast", True)) if impl == "ours" else ():
            out[side][how] = _plain_load(impl, ctx, broadcast, mesh=mesh, groups=groups)
    for impl, source in (("ours", "torch"), ("torch", "ours")):
        other = Run(impl, ctx, seed=4, mesh=mesh)
        other.load(folder / source)
        other.train(range(FIRST, TOTAL))
        out[impl][f"resumed from {source}"] = other.full()
    out["not a grid"] = _not_a_grid(ctx)
    return out


def _not_a_grid(ctx: RankContext) -> str:
    """Groups that are no 2-D grid (shard groups [0, 1], [2, 3]; replicate groups [0, 3],
    [1, 2]): the wrapper's error, the same on every rank (training would average one rank's
    shard gradients with another slice's)."""
    from cs336_systems.fsdp import FullyShardedDataParallel

    shard = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    replicate = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    try:
        FullyShardedDataParallel(build_model(CASE, rank=0), shard_group=shard[ctx.rank // 2],
                                 replicate_group=replicate[ctx.rank in (1, 2)])
    except ValueError as e:
        return str(e)
    return "no error"


def _plain_job(ctx: RankContext, folder: Path) -> dict:
    """At 2 ranks without hybrid sharding: ours' 4-rank hybrid checkpoint into ours and
    fully_shard, each trained on."""
    out: dict = {}
    for impl in ("ours", "torch"):
        run = Run(impl, ctx, seed=4)
        run.load(folder / "ours")
        out[f"{impl} optimizer"] = run.full_optimizer()
        run.train(range(FIRST, TOTAL))
        out[impl] = run.full()
    return out


def run_jobs(ctx: RankContext, root: str) -> dict:
    """Rank function (4 ranks): the hybrid job, then ranks 0 and 1 in a new 2-rank group."""
    done = {"hybrid": _hybrid_job(ctx, Path(root))}
    teardown()  # every rank done with the 4-rank group and the mesh's groups
    if ctx.rank >= 2:
        return done
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous-ws2", rank=ctx.rank,
                            world_size=2, timeout=timedelta(seconds=120))
    done["plain"] = _plain_job(replace(ctx, world_size=2, local_world_size=2), Path(root))
    return done


def _expected(step: int) -> dict[str, torch.Tensor]:
    """Single-process training's state dict after ``step`` (the tied weight under both names)."""
    state = train_reference(CASE)[step]
    return {**state, "lm_head.weight": state["embedding.weight"]}


def _check_layouts(results: list[dict]) -> None:
    # The tied lm_head.weight's moments are embedding.weight's, listed once.
    moments = {f"{name} {m}" for name in SHARDED[:-1] for m in ("exp_avg", "exp_avg_sq")}
    for rank, done in enumerate(results):
        theirs = done["hybrid"]["torch"]["layout"]
        assert theirs.keys() == {*SHARDED, *moments}, sorted(theirs)
        for side in ("ours", "ours-groups"):
            assert done["hybrid"][side]["layout"] == theirs, f"rank {rank}: {side} vs fully_shard"


def _check_exports(job: dict) -> None:
    ours, groups, theirs = job["ours"], job["ours-groups"], job["torch"]
    for moment, step in (("exported", FIRST - 1), ("uninterrupted", TOTAL - 1)):
        _assert_same(ours[moment], _expected(step), f"ours {moment} vs single process")
        _assert_same(ours[moment], theirs[moment], f"ours {moment} vs fully_shard's")
    _assert_same(groups["exported"], ours["exported"], "groups form's export vs the mesh form's", atol=0.0)
    assert ours["optimizer"]["param_groups"] == theirs["optimizer"]["param_groups"]
    assert ours["optimizer"]["state"].keys() == theirs["optimizer"]["state"].keys()
    for name, state in theirs["optimizer"]["state"].items():
        _assert_same(ours["optimizer"]["state"][name], state, f"AdamW state of {name}, ours vs fully_shard")
        _assert_same(groups["optimizer"]["state"][name], ours["optimizer"]["state"][name],
                     f"AdamW state of {name}, groups vs mesh form", atol=0.0)
    plain = build_model(Case("plain", "adamw", seed=7), rank=0).state_dict()
    for side in ("ours", "ours-groups"):  # a plain model's state dict, whole and broadcast
        for how in ("plain", "plain broadcast"):
            _assert_same(job[side][how], plain, f"{side}: {how}", atol=0.0)


def _check_resumes(job: dict, plain: dict) -> None:
    for side, source in (("ours", "ours"), ("ours-groups", "ours"), ("torch", "torch")):
        _assert_same(job[side]["resumed"], job[source]["uninterrupted"], f"{side} resumed at 4", atol=0.0)
    final = _expected(TOTAL - 1)
    for impl, source in (("ours", "torch"), ("torch", "ours")):
        resumed = job[impl][f"resumed from {source}"]
        _assert_same(resumed, final, f"{source}'s checkpoint into {impl} vs single process")
        _assert_same(resumed, job[source]["uninterrupted"], f"{source}'s checkpoint into {impl}")
    for impl in ("ours", "torch"):
        what = f"ours' hybrid checkpoint at 4 into {impl} at 2 (plain sharding)"
        for name, state in job["ours"]["optimizer"]["state"].items():
            loaded = plain[f"{impl} optimizer"]["state"][name]
            _assert_same(loaded, state, f"{what}: AdamW state of {name}", atol=0.0)
        _assert_same(plain[impl], job["ours"]["uninterrupted"], f"{what} vs ours uninterrupted at 4")
        _assert_same(plain[impl], final, f"{what} vs single process")


def test_hybrid_checkpoints_as_fully_shard(tmp_path: Path):
    """One test: every check needs the hybrid job's checkpoints or results."""
    results = launch(run_jobs, 4, args=(str(tmp_path),), timeout_s=120)
    _check_layouts(results)
    _check_exports(results[0]["hybrid"])
    _check_resumes(results[0]["hybrid"], results[0]["plain"])
    for rank, done in enumerate(results):
        message = done["hybrid"]["not a grid"]
        assert message.startswith("shard_group and replicate_group do not form a 2-D grid"), message
        assert f"rank {rank}'s replicate group is " in message and "\n" not in message, message
