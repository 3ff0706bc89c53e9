"""Optimizer state sharding (ZeRO stage 1): each rank keeps the optimizer state of its shard only.

What is sharded. Data-parallel ranks hold identical copies of the parameters, the gradients and
the optimizer state. ZeRO (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", Sec. 5.1) notes that the optimizer state need not be
replicated: stage 1 ("P_os") gives every parameter one *owner* rank, which alone keeps that
parameter's state and alone runs the optimizer update for it. Parameters and gradients stay
replicated; only the optimizer state is divided.

One step. Every rank has the full gradient (it computed it, or DDP all-reduced it). Each rank
steps a local ``optimizer_cls`` built over the parameters it owns, with exactly the math and
values the unsharded optimizer would use for them, so its results are those of the unsharded
optimizer. Then every owner broadcasts its updated parameters to the other ranks. The
broadcasts are bucketed: an owner's parameters are packed per dtype and device into flat buffers
of at most ``bucket_size_mb``, one broadcast each, and all ranks issue the same broadcasts in the
same order (owner 0's buckets first).

Memory. Let P be the number of parameters. Training in fp32 with Adam keeps 4P bytes of
parameters, 4P of gradients and 8P of optimizer state (two moments) per rank: 16P. Sharded over
n ranks the state costs about 8P/n, for 8P + 8P/n in all (a rank's shard exceeds the average
by at most the largest parameter, see :func:`assign_to_ranks`), plus one bucket of transient
buffer during the broadcasts. In the paper's mixed-precision accounting (K = 12 bytes of state
per parameter) stage 1 lowers 16P to 4P + 12P/n, e.g. 120 GB to 31.4 GB for a 7.5B-parameter
model on 64 ranks (paper, Fig. 1).

Communication. Let B be the parameter bytes. DDP's ring all-reduce of the gradients sends and
receives 2(n-1)/n * B per rank per step. This sharded optimizer adds the parameter broadcasts:
each rank receives every parameter it does not own, about (n-1)/n * B per step, the volume of
an all-gather. Composed with a DDP that all-reduces full gradients, a step thus moves about
3(n-1)/n * B per rank, 1.5x DDP. The paper's ZeRO-1 instead reduce-scatters the gradients (each
owner needs only its own) and all-gathers the parameters, (n-1)/n * B each, which is exactly
DDP's volume (paper, Sec. 7.2.1); that requires the gradient reduction to know the sharding,
which the DDP wrappers of this repo do not.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from cs336_systems.comm.coalesced import broadcast_coalesced

MB = 2**20  # bucket sizes are in MiB, as torch DDP's bucket_cap_mb
STATE_DICT_FORMAT = "cs336_systems.ShardedOptimizer/1"  # tags state_dict() output

# Keys of a param group that are not hyperparameters: the local optimizer's groups hold only
# the owned subset of these.
_PARAM_KEYS = ("params", "param_names")


def assign_to_ranks(
    sizes: Sequence[int], world_size: int, initial_loads: Sequence[int] | None = None
) -> list[int]:
    """The owner rank of each item: largest first, each to the currently least-loaded rank.

    Ties go to the lower item index and the lower rank, so every rank computes the same
    assignment from the same sizes without communicating. Greedy placement keeps
    ``max(load) - min(load) <= max(size)`` whatever the order (placing ``s`` on the least-loaded
    rank cannot push it more than ``s`` above the others), provided ``initial_loads`` already
    satisfied that bound, as loads produced by this function do: parameters added later land on
    top of the current loads without breaking balance.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    negative = [s for s in sizes if s < 0]
    if negative:
        raise ValueError(f"sizes must be >= 0, got {negative[:5]}")
    loads = [0] * world_size if initial_loads is None else list(initial_loads)
    if len(loads) != world_size:
        raise ValueError(
            f"initial_loads has {len(loads)} entries, but world_size is {world_size}"
        )
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + sizes[index], rank))
    return owners


def _check_bucket_size_mb(bucket_size_mb: float) -> int:
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)):
        raise ValueError(f"bucket_size_mb must be a positive number, got {bucket_size_mb!r}")
    if math.isnan(bucket_size_mb) or math.isinf(bucket_size_mb) or bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be finite and > 0, got {bucket_size_mb!r}")
    return max(1, int(bucket_size_mb * MB))


def _nbytes(param: torch.Tensor) -> int:
    return param.numel() * param.element_size()


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor inside it moved to the CPU (for pickling between ranks)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


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
        self.bucket_cap_bytes = _check_bucket_size_mb(bucket_size_mb)
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
        owners = assign_to_ranks([_nbytes(p) for p in params], self.world_size, self.loads)
        for param, owner in zip(params, owners):
            self.loads[owner] += _nbytes(param)
        self.owners.extend(owners)

        local_group = {k: v for k, v in group.items() if k not in _PARAM_KEYS}
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
            if key not in _PARAM_KEYS:
                group.setdefault(key, value)

    def owned_indices(self, rank: int) -> list[int]:
        """Indices (in param_groups order) of the parameters ``rank`` owns."""
        return [i for i, owner in enumerate(self.owners) if owner == rank]

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _push_hyperparameters(self) -> None:
        """Copy hyperparameters (maybe edited, e.g. by an LR scheduler) to the local groups."""
        assert self.local_optimizer is not None
        for group, local_group in zip(self.param_groups, self.local_optimizer.param_groups):
            for key, value in group.items():
                if key not in _PARAM_KEYS:
                    local_group[key] = value

    def _pull_hyperparameters(self) -> None:
        """Copy hyperparameters from the local groups (after loading a state dict into them)."""
        assert self.local_optimizer is not None
        for group, local_group in zip(self.param_groups, self.local_optimizer.param_groups):
            for key, value in local_group.items():
                if key not in _PARAM_KEYS:
                    group[key] = value

    # Step -----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:
        """Update this rank's shard, then receive every other shard from its owner.

        The local optimizer skips parameters whose gradient is None, as torch's optimizers do;
        they are broadcast unchanged, which keeps the broadcasts the same on every rank.
        """
        assert self.local_optimizer is not None
        self._push_hyperparameters()
        loss = self.local_optimizer.step(closure=closure, **kwargs)
        self.broadcast_calls_last_step = self._broadcast_shards()
        return loss

    def _broadcast_shards(self) -> int:
        if self.world_size == 1:
            return 0
        params = self._all_params()
        calls = 0
        for owner in range(self.world_size):
            # Empty tensors carry nothing; leaving them out keeps every buffer non-empty.
            owned = [params[i].detach() for i in self.owned_indices(owner) if params[i].numel()]
            calls += broadcast_coalesced(owned, src=owner, chunk_bytes=self.bucket_cap_bytes)
        return calls

    # Checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the local optimizer's state dict plus how the shards were cut.

        Enough to resume on the same world size with the same parameters, each rank loading
        its own file. For a checkpoint that any world size (or a plain ``optimizer_cls``) can
        load, use :meth:`consolidated_state_dict`. Like torch's, the returned tensors are the
        live state: save or copy them before stepping again.
        """
        assert self.local_optimizer is not None
        self._push_hyperparameters()
        return {
            "format": STATE_DICT_FORMAT,
            "world_size": self.world_size,
            "rank": self.rank,
            "owners": list(self.owners),
            "shard": self.local_optimizer.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` saved by this rank of a job with the same sharding."""
        assert self.local_optimizer is not None
        if state_dict.get("format") != STATE_DICT_FORMAT:
            raise ValueError(
                f"not a ShardedOptimizer.state_dict() (format {state_dict.get('format')!r}, "
                f"expected {STATE_DICT_FORMAT!r}); for a torch-format state dict of the whole "
                "optimizer use load_consolidated_state_dict()"
            )
        if state_dict["world_size"] != self.world_size:
            raise ValueError(
                f"state dict was saved with world size {state_dict['world_size']}, but this job "
                f"has world size {self.world_size}; save with consolidated_state_dict() and load "
                "with load_consolidated_state_dict() to change the world size"
            )
        if state_dict["rank"] != self.rank:
            raise ValueError(
                f"state dict holds the shard of rank {state_dict['rank']}, but this is rank "
                f"{self.rank}: each rank must load its own shard"
            )
        if list(state_dict["owners"]) != self.owners:
            raise ValueError(
                f"state dict assigns {len(state_dict['owners'])} parameters to ranks differently "
                f"from this optimizer ({len(self.owners)} parameters): were the parameters or "
                "param groups built differently?"
            )
        self.local_optimizer.load_state_dict(state_dict["shard"])
        self._pull_hyperparameters()

    def consolidated_state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state in torch's format, on every rank (tensors on the CPU).

        A collective: call it on all ranks. It gathers every shard, so each rank briefly holds
        the full state that sharding saves; meant for checkpoints. The result loads into an
        unsharded ``optimizer_cls`` over the same parameters, or, through
        :meth:`load_consolidated_state_dict`, into a ShardedOptimizer of any world size.
        """
        assert self.local_optimizer is not None
        self._push_hyperparameters()
        shards: list[Any] = [None] * self.world_size
        dist.all_gather_object(shards, _to_cpu(self.local_optimizer.state_dict()))
        state: dict[int, Any] = {}
        for rank, shard in enumerate(shards):
            # The local optimizer numbers its parameters in the order it holds them: the
            # owned ones, in param_groups order.
            global_index = self.owned_indices(rank)
            for local_index, param_state in shard["state"].items():
                state[global_index[local_index]] = param_state
        param_groups = []
        start = 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            param_groups.append(packed)
        return {"state": dict(sorted(state.items())), "param_groups": param_groups}

    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a torch-format state dict of the whole optimizer, keeping this rank's shard.

        Accepts :meth:`consolidated_state_dict` output from any world size, or the
        ``state_dict()`` of an unsharded ``optimizer_cls`` over the same parameters.
        """
        assert self.local_optimizer is not None
        saved_groups = state_dict["param_groups"]
        saved_sizes = [len(g["params"]) for g in saved_groups]
        sizes = [len(g["params"]) for g in self.param_groups]
        if saved_sizes != sizes:
            raise ValueError(
                f"state dict has param groups of sizes {saved_sizes}, but this optimizer has "
                f"{sizes}"
            )
        saved_ids = [i for g in saved_groups for i in g["params"]]
        local_state = {}
        local_groups = []
        start = 0
        for saved_group, size in zip(saved_groups, sizes):
            mine = [i for i in range(size) if self.owners[start + i] == self.rank]
            local_group = {k: v for k, v in saved_group.items() if k not in _PARAM_KEYS}
            local_group["params"] = list(range(len(local_state), len(local_state) + len(mine)))
            if "param_names" in saved_group:
                local_group["param_names"] = [saved_group["param_names"][i] for i in mine]
            for local_index, i in zip(local_group["params"], mine):
                local_state[local_index] = state_dict["state"].get(saved_ids[start + i])
            local_groups.append(local_group)
            start += size
        shard = {
            "state": {k: v for k, v in local_state.items() if v is not None},
            "param_groups": local_groups,
        }
        self.local_optimizer.load_state_dict(shard)
        self._pull_hyperparameters()
