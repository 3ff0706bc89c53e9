"""The options people set on FSDP, each as torch's ``fully_shard`` (FSDP2) names and defaults it.

=========================  =======  ===========================================================
option                     default  what it does (torch's counterpart)
=========================  =======  ===========================================================
``reshard_after_forward``  True     False: a layer's gathered weight stays from its forward to
                                    its backward, so backward gathers nothing again; more
                                    memory (``fully_shard(reshard_after_forward=...)``)
``sync_module_states``     True     rank 0's parameters and buffers are broadcast before
                                    sharding; False: each rank keeps its slice of its own values
                                    and, with the handout's sharding, the parameters it does not
                                    shard (biases, norms) are still broadcast from rank 0, so
                                    one model exists after wrapping, as under FSDP2 where every
                                    parameter is sharded (FSDP1's flag; FSDP2 never broadcasts)
``reduce_dtype``           None     the dtype gradients are reduced in; None: float32, the master
                                    shards' dtype (``MixedPrecisionPolicy(reduce_dtype=...)``;
                                    ``compute_dtype`` is its ``param_dtype``)
``cast_forward_inputs``    True     with a ``compute_dtype``, floating inputs of the model (and of
                                    each unit, with every parameter sharded) are cast to it
                                    (``MixedPrecisionPolicy(cast_forward_inputs=...)``)
``activation_checkpointing`` False  every element of every ``nn.ModuleList`` (a Transformer's
                                    blocks) runs under ``torch.utils.checkpoint`` (non-reentrant)
                                    and is recomputed in backward, weights gathered again for it
``device_mesh`` / groups   None     hybrid sharding (HSDP): a 2-D ``DeviceMesh`` with dimensions
                                    ("replicate", "shard"), or ``shard_group`` and
                                    ``replicate_group``: weights sharded within a shard group,
                                    shard gradients all-reduced across replicas
                                    (``fully_shard(mesh=<2-D mesh>)``); checkpoints present
                                    shards as ``fully_shard``'s, ``(Replicate(), Shard(0))``
                                    on the 2-D mesh (in the groups form, a mesh made
                                    from the groups; checkpoint.py)
=========================  =======  ===========================================================

Gradient accumulation is a context, not an option: backward passes inside
``FullyShardedDataParallel.no_sync()`` sum full gradients locally and skip every reduction, and
the first backward outside it reduces the sum (torch's ``set_requires_gradient_sync(False)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # imported late elsewhere: absent from some builds
    from torch.distributed.device_mesh import DeviceMesh

# The dtypes weights may be gathered and computed in, and gradients reduced in (None: the
# parameters' own, and float32).
COMPUTE_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)
REDUCE_DTYPES = COMPUTE_DTYPES


@dataclass(frozen=True)
class FsdpOptions:
    """The configuration of one FSDP wrapper beyond its compute dtype (see the module docstring)."""

    reshard_after_forward: bool = True
    sync_module_states: bool = True
    reduce_dtype: torch.dtype | None = None  # None: float32
    activation_checkpointing: bool = False
    device_mesh: DeviceMesh | None = None  # 2-D, dimensions ("replicate", "shard")
    shard_group: dist.ProcessGroup | None = None
    replicate_group: dist.ProcessGroup | None = None
    cast_forward_inputs: bool = True

    def validate(self, exact_gradients: bool) -> None:
        """Every check that needs no collective; one-line errors naming the value."""
        for name in ("reshard_after_forward", "sync_module_states", "activation_checkpointing",
                     "cast_forward_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(
                "reduce_dtype must be one of None (float32), torch.float32, torch.float16 or "
                f"torch.bfloat16; got {self.reduce_dtype!r}"
            )
        if (self.shard_group is None) != (self.replicate_group is None):
            raise ValueError("hybrid sharding needs both shard_group and replicate_group, or neither")
        if self.device_mesh is not None and self.shard_group is not None:
            raise ValueError("give either device_mesh or shard_group/replicate_group, not both")
        if self.device_mesh is not None:
            names = getattr(self.device_mesh, "mesh_dim_names", None)
            if getattr(self.device_mesh, "ndim", None) != 2 or tuple(names or ()) != ("replicate", "shard"):
                raise ValueError(
                    "device_mesh must be a 2-D DeviceMesh with mesh_dim_names ('replicate', 'shard'); "
                    f"got {self.device_mesh!r}"
                )
        changed = [name for name, default in _NOT_EXACT.items() if getattr(self, name) != default]
        if exact_gradients and (changed or self.is_hybrid):
            raise ValueError(
                "exact_gradients=True runs only with the default options; got "
                + ", ".join(changed + (["hybrid sharding"] if self.is_hybrid else []))
            )

    @property
    def is_hybrid(self) -> bool:
        return self.device_mesh is not None or self.shard_group is not None

    def groups(self) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """(the group weights are sharded over, the group shard gradients are all-reduced over);
        (None, None) without hybrid sharding: shard over the whole world, no replicas."""
        if self.device_mesh is not None:
            mesh = self.device_mesh
            return mesh.get_group("shard"), mesh.get_group("replicate")
        return self.shard_group, self.replicate_group

    def grid(self) -> torch.Tensor:
        """The ranks as a 2-D grid, a row per shard group and a column per replicate group: the
        mesh's own, or with groups the rows of this rank's replicate group gathered over it (a
        collective: every rank calls it). Every row must cross every column; where the groups
        form no grid, a rank's shard gradients would be averaged with other slices' (ValueError,
        on every rank)."""
        if self.device_mesh is not None:
            return self.device_mesh.mesh
        shard_group, replicate_group = self.groups()
        assert shard_group is not None and replicate_group is not None
        row = [dist.get_global_rank(shard_group, j) for j in range(shard_group.size())]
        rows: list[list[int] | None] = [None] * replicate_group.size()
        dist.all_gather_object(rows, row, group=replicate_group)  # on any backend's device
        grid = torch.tensor(rows)
        column = [dist.get_global_rank(replicate_group, i) for i in range(replicate_group.size())]
        shard_rank = dist.get_rank(shard_group)
        if grid[:, shard_rank].tolist() != column:
            raise ValueError(
                f"shard_group and replicate_group do not form a 2-D grid: rank {dist.get_rank()}'s "
                f"replicate group is {column}, but shard rank {shard_rank} of its members' shard "
                f"groups {grid.tolist()} is {grid[:, shard_rank].tolist()}"
            )
        return grid

    @property
    def reduce_in(self) -> torch.dtype:
        return self.reduce_dtype or torch.float32


_NOT_EXACT = {"reshard_after_forward": True, "reduce_dtype": None, "activation_checkpointing": False}
