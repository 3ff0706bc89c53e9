"""Each FSDP option configured the same way on our FSDP and on torch's ``fully_shard`` (FSDP2).

One :class:`OptionSpec` per row of the options table; :func:`build_side` wraps a copy of a
model with it on either side. Torch's side is ``fully_shard`` on every element of the model's
``layers`` (the Transformer's blocks) and then on the model, as its documentation lays it out;
ours wraps the model once. The tests (tests/test_fsdp_options.py) train both sides with these
builders and compare weights, bytes and collectives; the benchmark (options_run.py) times them.

The options:

* ``defaults``: every option at its default (reshard after forward, float32, no accumulation);
* ``no-reshard``: ``reshard_after_forward=False`` on both;
* ``accumulate``: 4 micro-batches per step, the first 3 inside our ``no_sync()`` /
  under torch's ``set_requires_gradient_sync(False)``, each loss divided by 4;
* ``checkpointing``: every block under ``torch.utils.checkpoint`` (fsdp/activation_checkpointing.py's
  ``checkpoint_layers``, the same call on both sides);
* ``bf16``: compute in bfloat16, float32 master shards, gradients reduced in float32
  (``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``);
* ``bf16-reduce-bf16``: the same, gradients reduced in bfloat16;
* ``hybrid``: shard over 2 ranks, replicate across world size / 2 (a 2-D ``DeviceMesh``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_systems.fsdp import FullyShardedDataParallel, checkpoint_layers

OURS, TORCH = "ours", "torch"
SHARD_SIZE = 2  # hybrid sharding: ranks per shard group


@dataclass(frozen=True)
class OptionSpec:
    """One FSDP configuration, as both sides take it."""

    name: str
    description: str
    reshard_after_forward: bool = True
    micro_batches: int = 1  # > 1: gradient accumulation, all but the last under no_sync
    checkpointing: bool = False
    param_dtype: torch.dtype | None = None  # compute dtype; None: float32
    reduce_dtype: torch.dtype | None = None  # None: float32
    hybrid: bool = False

    def runs_at(self, world_size: int) -> bool:
        """Hybrid sharding needs at least two shard groups of SHARD_SIZE ranks."""
        return not self.hybrid or (world_size % SHARD_SIZE == 0 and world_size > SHARD_SIZE)


SPECS = {
    s.name: s
    for s in (
        OptionSpec("defaults", "every option at its default"),
        OptionSpec("no-reshard", "reshard_after_forward=False", reshard_after_forward=False),
        OptionSpec("accumulate", "4 micro-batches per step, 3 under no_sync", micro_batches=4),
        OptionSpec("checkpointing", "torch.utils.checkpoint on every block", checkpointing=True),
        OptionSpec("bf16", "bf16 compute, fp32 reduce", param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        OptionSpec("bf16-reduce-bf16", "bf16 compute, bf16 reduce", param_dtype=torch.bfloat16,
                   reduce_dtype=torch.bfloat16),
        OptionSpec("hybrid", f"shard over {SHARD_SIZE} ranks, replicate across the rest", hybrid=True),
    )
}


def hybrid_mesh(device_type: str):
    """The 2-D (replicate, shard) mesh over the world: shard groups of consecutive ranks."""
    from torch.distributed.device_mesh import init_device_mesh  # late: absent from some builds

    world = dist.get_world_size()
    return init_device_mesh(device_type, (world // SHARD_SIZE, SHARD_SIZE), mesh_dim_names=("replicate", "shard"))


@dataclass
class OptionSide:
    """One side of one option as built: the model called, its optimizer, how a step runs."""

    spec: OptionSpec
    side: str  # OURS or TORCH
    model: nn.Module  # called on tokens
    module: nn.Module  # the model inside
    optimizer: torch.optim.Optimizer
    finish: Callable[[], None] | None  # ours: finish_gradient_synchronization

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        """One optimizer step over this rank's rows, in ``spec.micro_batches`` micro-batches."""
        k = self.spec.micro_batches
        if tokens.shape[0] % k:
            raise ValueError(f"option {self.spec.name!r}: {tokens.shape[0]} rows of this rank cannot be split "
                             f"into {k} equal micro-batches")
        self.optimizer.zero_grad(set_to_none=True)
        for i, (tok, tgt) in enumerate(zip(tokens.chunk(k), targets.chunk(k))):
            last = i == k - 1
            with self._sync(last):
                logits = self.model(tok)
                loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten()) / k
                loss.backward()
        if self.finish is not None:
            self.finish()
        self.optimizer.step()

    def _sync(self, sync: bool):
        if self.side == OURS:
            return self.model.no_sync() if not sync else _nothing()
        self.model.set_requires_gradient_sync(sync)
        return _nothing()

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by its name in the model (a collective)."""
        if self.side == OURS:
            return self.model.gather_full_params()
        return {n: p.full_tensor().detach().clone() for n, p in self.module.named_parameters()}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def build_side(spec: OptionSpec, side: str, base: nn.Module,
               make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
               mesh=None, sync_module_states: bool = True) -> OptionSide:
    """``spec`` on a copy of ``base`` (collective: every rank builds alike, in the same order).

    ``mesh``: the hybrid mesh (hybrid_mesh) when ``spec.hybrid``. ``sync_module_states`` (ours
    only: torch's FSDP2 never broadcasts) is the flag the sync tests turn off.
    """
    module = copy.deepcopy(base)
    if spec.hybrid and mesh is None:
        raise ValueError(f"option {spec.name!r} needs the 2-D mesh (hybrid_mesh)")
    if side == OURS:
        fsdp = FullyShardedDataParallel(
            module, compute_dtype=spec.param_dtype, reshard_after_forward=spec.reshard_after_forward,
            sync_module_states=sync_module_states, reduce_dtype=spec.reduce_dtype,
            activation_checkpointing=spec.checkpointing, device_mesh=mesh if spec.hybrid else None,
        )
        return OptionSide(spec, side, fsdp, module, make_optimizer(list(fsdp.parameters())),
                          fsdp.finish_gradient_synchronization)
    if side != TORCH:
        raise ValueError(f"side must be {OURS!r} or {TORCH!r}, got {side!r}")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if spec.checkpointing:
        checkpoint_layers(module)
    device = next(module.parameters()).device.type
    if not spec.hybrid:
        mesh = DeviceMesh.from_group(dist.group.WORLD, device)
    policy = MixedPrecisionPolicy(param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype)
    kwargs = dict(mesh=mesh, reshard_after_forward=spec.reshard_after_forward, mp_policy=policy)
    for block in module.layers:
        fully_shard(block, **kwargs)
    model = fully_shard(module, **kwargs)
    return OptionSide(spec, side, model, module, make_optimizer(list(model.parameters())), None)
