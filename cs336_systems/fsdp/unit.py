"""A unit: the sharded weights of one block, moved by one all-gather and one reduce-scatter.

Each weight keeps its own shard (sharded_weight.py), so the optimizer, the state dicts and the
checkpoints see one parameter per weight. What a unit changes is how many collectives carry
them: a Transformer block's seven weights would otherwise take seven all-gathers in forward,
seven more in backward and seven reduce-scatters, each paying the collective's fixed latency
(on gloo, a round of messages between every pair of neighbours; on a CPU shared by its ranks,
context switches too). torch's ``fully_shard`` groups the same way: one all-gather and one
reduce-scatter per module it was applied to (its ``FSDPParamGroup``).

One collective for several weights needs them side by side in one buffer:

* gather: each rank concatenates its shards of the members to gather (``S`` elements), one
  ``all_gather_into_tensor`` fills a ``world_size x S`` buffer whose row ``r`` is rank ``r``'s
  concatenation, and each member's full (padded) weight is copied out of its columns, as
  torch's ``fully_shard`` copies out of its all-gather output;
* reduce: each member's full gradient, viewed as ``world_size`` rows of one shard each, is
  copied into its columns of a ``world_size x S`` buffer, one ``reduce_scatter_tensor`` sums
  row ``r`` of every rank into rank ``r``'s ``S`` elements, and each member's reduced slice is
  its columns of that output, a view.

The members gathered are those not gathered already, in the unit's fixed order, and every rank
asks for the same ones: the requests come from hooks that fire in the order of the autograd
graph, which every rank shares (schedule.py). A unit of one member skips the copies.

Units are chosen by :func:`unit_keys`: every element of an ``nn.ModuleList`` (a Transformer's
block) is one unit; a sharded layer outside every list (an embedding, an LM head) is a unit of
its own, so it is gathered only around its own call.

Where full weights are put in place is a :class:`Call`: a module whose forward hooks swap full
weights into named parameter slots for the call and put the shards back after it. With the
handout's sharding (Linear and Embedding weights) each such layer is a call of one slot, its
``weight``. With every parameter sharded (``shard="all"``, or ``fully_shard``) a unit's module
is the call and its slots are every parameter in its subtree outside nested units, whoever
reads them (``nn.MultiheadAttention`` reads ``in_proj_weight`` and ``out_proj.weight``
without calling a Linear), as torch's ``fully_shard`` unshards a module's parameters in its
forward pre-hook.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.fsdp.sharded_weight import ShardedWeight


def unit_keys(module: nn.Module, layer_names: Sequence[str]) -> dict[str, str]:
    """Each sharded layer's unit, by name: the innermost ``nn.ModuleList`` element holding it,
    or the layer itself outside every list."""
    elements = {
        f"{name}.{index}" if name else str(index)
        for name, m in module.named_modules()
        if isinstance(m, nn.ModuleList)
        for index in range(len(m))
    }
    keys = {}
    for layer in layer_names:
        parts = layer.split(".")
        prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
        keys[layer] = next((p for p in prefixes if p in elements), layer)
    return keys


class UnitGather:
    """The in-flight all-gather of a unit's members: waiting copies every member's full weight
    out of the shared buffer. It stands where a member would keep its own ``dist.Work``."""

    def __init__(self, work: dist.Work, gathered: torch.Tensor, members: list[ShardedWeight]):
        self._work: dist.Work | None = work
        self._gathered = gathered  # world_size x S
        self._members = members

    def wait(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        offset = 0
        for weight in self._members:
            columns = self._gathered[:, offset : offset + weight.layout.shard_numel]
            offset += weight.layout.shard_numel
            weight.fill_gathered(self, columns)
        self._gathered = self._gathered.new_empty(0)  # the shared buffer goes now, not at exit


class Call:
    """A module whose forward runs with full weights: ``slots`` are the (module, parameter name,
    weight) places they are swapped into; ``reshard`` False keeps them gathered from forward to
    backward (a root's, as ``fully_shard`` keeps its root's)."""

    def __init__(self, slots: list[tuple[nn.Module, str, ShardedWeight]], reshard: bool = True):
        self.slots = slots
        self.reshard = reshard
        self.depth = 0  # calls under way (pre-hook ran, post-hook not yet)
        self.forward_prefetch: list[Unit] | None = None  # set_modules_to_forward_prefetch's (None: the next)
        self.weights = list({id(w): w for _, _, w in slots}.values())  # distinct, in slot order


class Unit:
    """The members of one unit, in a fixed order every rank shares."""

    def __init__(self, name: str, members: list[ShardedWeight]):
        self.name = name
        self.members = members
        self.reshard_after_backward = True  # False: stays gathered after its gradient (torch's setter)
        self.backward_prefetch: list[Unit] | None = None  # set_modules_to_backward_prefetch's (None: the next)

    def start_gather(self) -> list[ShardedWeight]:
        """Launch one all-gather of every member not gathered (or gathering); returns them."""
        todo = [w for w in self.members if not w.is_gathered]
        if len(todo) == 1:
            todo[0].start_gather()
        elif todo:
            dtype, group = todo[0].compute_dtype, todo[0].group
            send = torch.cat([w.shard.detach().to(dtype) for w in todo])
            world_size = todo[0].layout.world_size
            gathered = send.new_empty(world_size * send.numel())  # gloo wants it flat
            work = dist.all_gather_into_tensor(gathered, send, group=group, async_op=True)
            pending = UnitGather(work, gathered.view(world_size, -1), todo)
            for weight in todo:
                weight.await_gather(pending)
        return todo

    def ready_to_reduce(self) -> bool:
        """Every member's expected gradients have arrived, and some member has one to reduce."""
        return (all(w.grads_in >= w.uses for w in self.members)
                and any(w.has_unreduced_grad for w in self.members))

    def reduce_scatter(self, reduce_dtype: torch.dtype) -> tuple[dist.Work, torch.Tensor, torch.Tensor]:
        """Launch one sum-reduce-scatter of every member with a gradient to reduce.

        Returns the work, its input (kept alive until waited for) and its output, whose slices
        the members hold as their reduced gradients (hybrid sharding all-reduces it next).
        """
        todo = [w for w in self.members if w.has_unreduced_grad]
        if len(todo) == 1:
            work, full_grad = todo[0].reduce_scatter(reduce_dtype)
            return work, full_grad, todo[0].reduced_slices[-1]
        world_size = todo[0].layout.world_size
        widths = [w.layout.shard_numel for w in todo]
        full = torch.empty(world_size, sum(widths), dtype=reduce_dtype, device=todo[0].shard.device)
        offset = 0
        for weight, width in zip(todo, widths):
            full[:, offset : offset + width].copy_(weight.take_grad().view(world_size, width))
            offset += width
        out = full.new_empty(sum(widths))
        work = dist.reduce_scatter_tensor(out, full.view(-1), group=todo[0].group, async_op=True)
        offset = 0
        for weight, width in zip(todo, widths):
            weight.reduced_slices.append(out[offset : offset + width])
            offset += width
        return work, full, out


def build_units(weights_by_layer: dict[str, ShardedWeight], keys: dict[str, str]) -> list[Unit]:
    """Group the weights into units (a tied weight joins the unit of its first layer); members
    of one unit share a compute dtype, so a unit mixing dtypes is split by dtype."""
    grouped: dict[tuple[str, torch.dtype], list[ShardedWeight]] = {}
    seen: set[int] = set()
    for layer, weight in weights_by_layer.items():
        if id(weight) in seen:
            continue
        seen.add(id(weight))
        grouped.setdefault((keys[layer], weight.compute_dtype), []).append(weight)
    units = []
    for (key, _), members in grouped.items():
        unit = Unit(key, members)
        for weight in members:
            weight.unit = unit
        units.append(unit)
    return units
