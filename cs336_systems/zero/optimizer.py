""":class:`ShardedOptimizer`: ZeRO stage 1 over any ``torch.optim`` optimizer (see the package docstring).

One step. Every rank has the full gradient (it computed it, or DDP all-reduced it). Each rank
steps a local ``optimizer_cls`` built over the parameters it owns, with exactly the math and
values the unsharded optimizer would use for them, so its results are those of the unsharded
optimizer. Then every owner broadcasts its updated parameters to the other ranks
(broadcast.py): large parameters from their own storage, small ones packed per dtype and device
into flat buffers of at most ``bucket_size_mb``, all issued asynchronously in the same order on
every rank (owner 0's first) and finished before the step returns.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from cs336_systems.ddp.bucket import bucket_cap_bytes
from cs336_systems.zero import checkpoint
from cs336_systems.zero.assignment import assign_to_ranks, parameter_bytes
from cs336_systems.zero.broadcast import broadcast_shards
from cs336_systems.zero.checkpoint import PARAM_KEYS


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer_cls`` so that each rank keeps the state of its own parameters only.

    ``param_groups`` hold every parameter, as in the unsharded optimizer, and are the source of
    truth for hyperparameters (LR schedulers may edit them); ``local_optimizer`` is an
    ``optimizer_cls`` over this rank's shard, one group per group here (possibly empty).
    ``state`` is the local optimizer's: it has entries for owned parameters only.

    Use it as any optimizer, on every rank of the default process group alike: build it over
    the same parameters in the same order, and call :meth:`step` on all ranks (it communicates).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        bucket_size_mb: float = 32.0,
        **kwargs: Any,
    ):
        is_class = isinstance(optimizer_cls, type)
        if not (is_class and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(
                f"optimizer_cls must be a subclass of torch.optim.Optimizer, got {optimizer_cls!r}"
            )
        self.bucket_cap_bytes = bucket_cap_bytes(bucket_size_mb)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "the default process group is not initialised: call "
                "cs336_systems.launch.init_from_env() (or launch()) before building a "
                "ShardedOptimizer"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.optimizer_cls = optimizer_cls
        self.optimizer_kwargs = dict(kwargs)
        self.local_optimizer: torch.optim.Optimizer | None = None
        self.owners: list[int] = []  # owner rank of each parameter, in param_groups order
        self.loads = [0] * self.world_size  # bytes of parameters owned by each rank
        # The parameters each rank owns, in param_groups order: what it broadcasts every step.
        self._shards: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        self.broadcast_calls_last_step = 0
        # The base class calls self.add_param_group for each group, which builds the shard.
        super().__init__(params, defaults=dict(kwargs))
        assert self.local_optimizer is not None
        self.state = self.local_optimizer.state

    # Sharding -------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to every rank's view; its parameters go to the least-loaded ranks."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        params = group["params"]
        owners = assign_to_ranks([parameter_bytes(p) for p in params], self.world_size, self.loads)
        for param, owner in zip(params, owners):
            self.loads[owner] += parameter_bytes(param)
            self._shards[owner].append(param)
        self.owners.extend(owners)

        local_group = {k: v for k, v in group.items() if k not in PARAM_KEYS}
        mine = [i for i, owner in enumerate(owners) if owner == self.rank]
        local_group["params"] = [params[i] for i in mine]
        if "param_names" in group:
            local_group["param_names"] = [group["param_names"][i] for i in mine]
        # torch.optim.Optimizer accepts a group with no parameters (only an empty list of
        # groups is refused), so a rank that owns nothing of this group still gets one:
        # local group j always mirrors group j.
        if self.local_optimizer is None:
            self.local_optimizer = self.optimizer_cls([local_group], **self.optimizer_kwargs)
        else:
            self.local_optimizer.add_param_group(local_group)
        # Fill in the optimizer's own defaults (amsgrad, maximize, ...), so that the groups
        # here read like those of an unsharded optimizer_cls.
        for key, value in self.local_optimizer.param_groups[-1].items():
            if key not in PARAM_KEYS:
                group.setdefault(key, value)

    def owned_indices(self, rank: int) -> list[int]:
        """Indices (in param_groups order) of the parameters ``rank`` owns."""
        return [i for i, owner in enumerate(self.owners) if owner == rank]

    def owned_parameters(self) -> list[torch.Tensor]:
        """The parameters whose optimizer state this rank keeps."""
        params = self._all_params()
        return [params[i] for i in self.owned_indices(self.rank)]

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _copy_hyperparameters(self, to_local: bool) -> None:
        """Copy hyperparameters to the local groups (``to_local``: they may have been edited, e.g. by an
        LR scheduler) or back from them (after a state dict was loaded into them)."""
        assert self.local_optimizer is not None
        for group, local_group in zip(self.param_groups, self.local_optimizer.param_groups):
            source, target = (group, local_group) if to_local else (local_group, group)
            for key, value in source.items():
                if key not in PARAM_KEYS:
                    target[key] = value

    # Step -----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:
        """Update this rank's shard, then receive every other shard from its owner.

        The local optimizer skips parameters whose gradient is None, as torch's optimizers do;
        they are broadcast unchanged, which keeps the broadcasts the same on every rank.
        """
        assert self.local_optimizer is not None
        self._copy_hyperparameters(to_local=True)
        loss = self.local_optimizer.step(closure=closure, **kwargs)
        self.broadcast_calls_last_step = self._broadcast_shards()
        return loss

    def _broadcast_shards(self) -> int:
        if self.world_size == 1:
            return 0
        return broadcast_shards(self._shards, self.rank, self.bucket_cap_bytes)

    def release(self) -> None:
        """Before ``destroy_process_group()``: nothing to let go of, by design.

        Every broadcast of :meth:`step` is finished, and its flat buffer dropped, before the step
        returns (broadcast.py), and no process group is kept, so between steps this optimizer
        holds no work, future or communication buffer (the reason to release one:
        cs336_systems/launch/lifetime.py). The method exists so that code can release every
        wrapper and optimizer alike.
        """

    # Checkpoints (formats in checkpoint.py) ---------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the local optimizer's state dict plus how the shards were cut.

        Enough to resume on the same world size with the same parameters, each rank loading
        its own file. For a checkpoint that any world size (or a plain ``optimizer_cls``) can
        load, use :meth:`consolidated_state_dict`. Like torch's, the returned tensors are the
        live state: save or copy them before stepping again.
        """
        self._copy_hyperparameters(to_local=True)
        return checkpoint.shard_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` saved by this rank of a job with the same sharding."""
        assert self.local_optimizer is not None
        checkpoint.check_shard_state_dict(self, state_dict)
        self.local_optimizer.load_state_dict(state_dict["shard"])
        self._copy_hyperparameters(to_local=False)

    def consolidated_state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state in torch's format, on every rank (tensors on the CPU).

        A collective: call it on all ranks. It gathers every shard, so each rank briefly holds
        the full state that sharding saves; meant for checkpoints. The result loads into an
        unsharded ``optimizer_cls`` over the same parameters, or, through
        :meth:`load_consolidated_state_dict`, into a ShardedOptimizer of any world size.
        """
        self._copy_hyperparameters(to_local=True)
        return checkpoint.consolidated_state_dict(self)

    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a torch-format state dict of the whole optimizer, keeping this rank's shard.

        Accepts :meth:`consolidated_state_dict` output from any world size, or the
        ``state_dict()`` of an unsharded ``optimizer_cls`` over the same parameters.
        """
        assert self.local_optimizer is not None
        self.local_optimizer.load_state_dict(checkpoint.local_shard_of(self, state_dict))
        self._copy_hyperparameters(to_local=False)
