"""When FSDP's collectives run: gathers around each layer, prefetches, reductions in backward.

Collectives move units (unit.py): a gather of a weight gathers every member of its unit (a
Transformer block's weights) not gathered yet, in one all-gather, and a unit's gradients are
reduce-scattered together once every member's have arrived. Memory is still released weight
by weight: each is freed as soon as its own use is over.

Forward, for each use (a :class:`~cs336_systems.fsdp.unit.Call`: a sharded layer's call, or
with every parameter sharded a unit module's; a tied weight has one per module):

1. the forward pre-hook waits for its weights' all-gather (launched as a prefetch, or now) and
   launches the all-gather of the next unit's weights, taken from the order the previous
   forward ran the calls in, so it overlaps this unit's compute;
2. the module computes with the full weights, put in place of the shards for the call;
3. its forward hook puts the shards back and drops the full weights. Any tensor the layer saved
   for backward that lives in the full weight was replaced, when autograd saved it, by a
   marker (``torch.autograd.graph.saved_tensors_hooks``), so nothing keeps the memory alive.

Backward, for each use, in reverse: when autograd unpacks a marker, the weight is gathered
again with its unit (or its prefetch waited for) and the all-gather of the next unit backward
needs is launched. When the use's weight gradient arrives at :class:`_Unshard`, the full weight
is dropped and the gradient added to the weight's float32 sum; once every member of the unit
has had its last use's gradient, the unit's sums are reduce-scattered asynchronously while
backward goes on (reduction.py: at most ``MAX_REDUCTIONS_IN_FLIGHT`` pending at once, which
bounds the full gradients alive). :meth:`Schedule.finish`, queued with autograd's engine by the
first gradient of a backward so that it runs as that backward ends (as ``fully_shard``'s
post-backward callback), launches any reduction whose uses never all produced a gradient,
all-reduces the replicated parameters' gradients, waits, and installs the shards' gradients.

In exact-gradient mode (exact.py) a layer computes with the full weight detached instead of
through :class:`_Unshard`: its gradient arrives from exact.py, recomputed over the global batch,
and each rank keeps its slice of it rather than reduce-scattering.

torch's ``FSDPModule`` setters (module_api.py) change three: a call's ``forward_prefetch`` and a
unit's ``backward_prefetch``, when set, are gathered in place of the default next unit, and a unit
with ``reshard_after_backward`` False stays gathered after its gradient, for the next forward.

The options (options.py) change four things here. ``reshard_after_forward=False``: forward
keeps each weight it used with a gradient expected gathered, and backward's unpack finds it
there, so no weight is gathered twice. Activation checkpointing: a layer rerun inside a
checkpoint's recomputation (checkpointing.is_recomputing) gathers its weight again without
counting a use, and keeps it until the original use's gradient arrives. ``no_sync()``
(``sync`` False): gradients are summed into the weights' float32 buffers across micro-batches
and nothing is reduced until a synchronised backward. Hybrid sharding: weights are sharded
over a shard group, and each reduce-scattered slice, once waited for, is all-reduced across
the replicas before it is installed (divided by the whole world size). ``reduce_dtype`` is the
dtype the summed gradient is cast to for every reduction.

Every rank must run the same layers in the same order (as with torch's FSDP): the collectives
are issued in the order the autograd graph dictates, and the graphs must agree to pair up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.comm.end_of_backward import AtEndOfBackward
from cs336_systems.fsdp.activation_checkpointing import is_recomputing
from cs336_systems.fsdp.reduction import Reductions
from cs336_systems.fsdp.sharded_weight import ShardedWeight
from cs336_systems.fsdp.unit import Call, Unit


class _Unshard(torch.autograd.Function):
    """The full weight as a function of the shard, so autograd hands us its gradient."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, weight: ShardedWeight, schedule: Schedule) -> torch.Tensor:
        ctx.weight, ctx.schedule = weight, schedule
        return weight.full()

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        ctx.schedule.on_weight_grad(ctx.weight, grad_full)
        # The shard's gradient is installed after the reduce-scatter, not by autograd.
        return None, None, None


@dataclass(frozen=True)
class _SavedFull:
    """What autograd keeps instead of a saved view of a full weight: how to rebuild the view."""

    weight: ShardedWeight
    size: torch.Size
    stride: tuple[int, ...]
    storage_offset: int


class Schedule:
    """Drives the gathers, prefetches and reductions of one FSDP-wrapped module."""

    def __init__(self, units: list[Unit], replicated: list[nn.Parameter], world_size: int,
                 group: dist.ProcessGroup | None, exact_gradients: bool = False, *,
                 reshard_after_forward: bool = True, reduce_dtype: torch.dtype = torch.float32,
                 replicate_group: dist.ProcessGroup | None = None):
        self.units = units  # in a fixed order every rank shares, as are their members
        self.weights = [w for unit in units for w in unit.members]
        self.replicated = replicated  # replicated parameters whose gradients are all-reduced
        # Exact mode (exact.py): weight gradients arrive recomputed over the global batch, so
        # each rank keeps its slice instead of reduce-scattering, and layers get detached weights.
        self.exact_gradients = exact_gradients
        self.exact = None  # the ExactGradients driving exact mode, set by the wrapper
        self.world_size = world_size  # every rank: gradients are averaged over all of them
        self.reshard_after_forward = reshard_after_forward  # False: keep gathered until backward
        self.sync = True  # False inside no_sync(): gradients are summed locally, not reduced
        # Reductions in flight (reduction.py): ``group`` all-reduces the replicated parameters'
        # gradients (None: the world); with hybrid sharding, shard gradients reduce-scattered
        # within the shard group are all-reduced across ``replicate_group`` (None: no replicas).
        self.reductions = Reductions(world_size, group, reduce_dtype, replicate_group)
        self.grad_pending = False  # a gradient arrived since the last finish()
        self._live: dict[int, ShardedWeight] = {}  # id -> weight gathered or being gathered
        self._storages: dict[int, ShardedWeight] = {}  # storage address -> weight computed with
        self._last_order: list[ShardedWeight] = []  # uses of the previous forward, in order
        self._forward_next: list[ShardedWeight | None] = []  # per use of it: the next unit's
        self._order: list[ShardedWeight] = []  # uses of this forward so far
        self._saved: list[bool] = []  # per use of this forward: did it save its full weight
        self._last_use: dict[int, int] = {}  # id(weight) -> its latest use's index in _order
        self._active: dict[int, int] = {}  # id(weight) -> calls under way computing with it
        self._kept: set[int] = set()  # weights a call kept gathered for backward
        self._backward_units: list[Unit] = []  # units whose weights backward gathers, in order
        self._backward_cursor = 0
        self._at_end_of_backward = AtEndOfBackward(self.finish)  # finish() when this backward ends
        self._biases: dict[nn.Module, nn.Parameter] = {}  # master biases of layers mid-call

    # -- gathering -----------------------------------------------------------------------------

    def start_gather(self, weight: ShardedWeight) -> None:
        """Gather the weight with every member of its unit not gathered yet (one all-gather)."""
        if not weight.is_gathered:
            assert weight.unit is not None
            self.gather_unit(weight.unit)

    def gather_unit(self, unit: Unit) -> None:
        """One all-gather of every member of ``unit`` not gathered yet (a prefetch)."""
        for member in unit.start_gather():
            self._live[id(member)] = member

    def full(self, weight: ShardedWeight) -> torch.Tensor:
        self.start_gather(weight)
        full = weight.full()
        self._storages[weight.storage_address()] = weight  # pack() finds views of it by this
        return full

    def free(self, weight: ShardedWeight) -> None:
        if weight.is_gathered:
            self._live.pop(id(weight), None)
            self._storages.pop(weight.storage_address(), None)
            weight.free()

    # -- forward -------------------------------------------------------------------------------

    def begin_forward(self) -> None:
        self._order, self._saved, self._last_use = [], [], {}

    def end_forward(self) -> None:
        for weight in list(self._live.values()):  # a prefetch the forward did not use
            kept = id(weight) in self._kept or not self.reshard_after_forward
            if not (kept and self._awaits_backward(weight)):
                self.free(weight)
        self._kept = set()
        self._last_order = self._order
        self._forward_next = _next_units(self._order)
        backward: list[Unit] = []  # units whose saved weights backward gathers, in its order
        for weight, saved in zip(reversed(self._order), reversed(self._saved)):
            if saved and weight.unit is not None and (not backward or backward[-1] is not weight.unit):
                backward.append(weight.unit)
        self._backward_units = backward
        self._backward_cursor = 0

    def _planned_next(self, index: int) -> ShardedWeight | None:
        """The first weight of another unit the uses after ``index`` had last forward, if this
        forward follows it."""
        last = self._last_order
        if index < len(last) and last[index] is self._order[index]:
            return self._forward_next[index]
        return None

    @torch.compiler.disable
    def pre_forward(self, call: Call) -> None:
        """Put the call's full weights in place (gathered, or waited for) and prefetch the next
        unit's."""
        recompute = is_recomputing()  # a checkpointed layer rerun in backward (activation_checkpointing.py)
        grad = torch.is_grad_enabled()
        call.depth += 1
        fulls: dict[int, torch.Tensor] = {}
        for weight in call.weights:
            if not recompute:
                self._last_use[id(weight)] = len(self._order)
                self._order.append(weight)
                self._saved.append(False)
            full = self.full(weight)
            if grad and weight.param.requires_grad:
                if recompute:  # no new use: the original use's gradient is the one that arrives
                    weight.recompute_holds += 1
                else:
                    weight.uses += 1
                if not self.exact_gradients:
                    full = _Unshard.apply(weight.shard, weight, self)
            self._active[id(weight)] = self._active.get(id(weight), 0) + 1
            fulls[id(weight)] = full
        if not recompute and call.forward_prefetch is not None:  # the user's list replaces ours
            for unit in call.forward_prefetch:
                self.gather_unit(unit)
        else:
            upcoming = None if recompute or not call.weights else self._planned_next(len(self._order) - 1)
            if upcoming is not None and upcoming.unit is not None:
                self.gather_unit(upcoming.unit)
        for module, name, weight in call.slots:
            module._parameters[name] = fulls[id(weight)]  # for this call only; post_forward restores
        if len(call.slots) == 1 and not self.exact_gradients:  # a layer's weight alone (the handout's)
            module, _, weight = call.slots[0]
            bias = module._parameters.get("bias")
            if bias is not None and bias.dtype != weight.compute_dtype:
                # A layer computes in one dtype: its (replicated) bias is cast for the call too,
                # differentiably, so its gradient comes back to the master in the master's dtype.
                self._biases[module] = bias
                module._parameters["bias"] = bias.to(weight.compute_dtype)

    @torch.compiler.disable
    def post_forward(self, call: Call) -> None:
        if not call.depth:
            return  # its pre-hook never ran (a forward that failed before it)
        call.depth -= 1
        for module, name, weight in call.slots:
            module._parameters[name] = weight.param
            if module in self._biases:
                module._parameters["bias"] = self._biases.pop(module)
        for weight in call.weights:
            self._active[id(weight)] -= 1
            if self._active[id(weight)]:
                continue  # an enclosing call (a tie across units) still computes with it
            if is_recomputing() and weight.recompute_holds:
                continue  # the rerun's saved tensors are views of it: freed when its gradient arrives
            if (not call.reshard or not self.reshard_after_forward) and self._awaits_backward(weight):
                self._kept.add(id(weight))
                continue  # kept for backward: no second all-gather
            self.free(weight)

    @staticmethod
    def _awaits_backward(weight: ShardedWeight) -> bool:
        return torch.is_grad_enabled() and weight.grads_in < weight.uses

    @torch.compiler.disable
    def pack(self, tensor: torch.Tensor):
        """saved_tensors_hooks pack: a view of a gathered weight becomes a :class:`_SavedFull`."""
        if not self._storages or tensor.layout != torch.strided:
            return tensor
        weight = self._storages.get(tensor.untyped_storage().data_ptr())
        if weight is None or tensor.dtype != weight.compute_dtype:
            return tensor
        index = self._last_use.get(id(weight))
        if index is not None:
            self._saved[index] = True
        return _SavedFull(weight, tensor.size(), tensor.stride(), tensor.storage_offset())

    # -- backward ------------------------------------------------------------------------------

    @torch.compiler.disable
    def unpack(self, saved):
        """saved_tensors_hooks unpack: gather the weight again, prefetch the next one."""
        if not isinstance(saved, _SavedFull):
            return saved
        weight = saved.weight
        self.start_gather(weight)
        order, cursor = self._backward_units, self._backward_cursor
        if cursor < len(order) and order[cursor] is weight.unit:
            self._backward_cursor = cursor = cursor + 1
            if weight.unit.backward_prefetch is not None:  # the user's list replaces ours
                for unit in weight.unit.backward_prefetch:
                    self.gather_unit(unit)
            elif cursor < len(order):  # prefetch the unit backward needs next
                self.gather_unit(order[cursor])
        padded = weight.padded()
        return padded.as_strided(saved.size, saved.stride, saved.storage_offset)

    def note_backward(self) -> None:
        """A gradient of a synchronised step arrived: :meth:`finish` is queued to run when this
        backward ends, as ``fully_shard`` queues its post-backward callback with autograd's
        engine, so no call after ``backward()`` is needed."""
        if not self.sync:
            return
        self.grad_pending = True
        self._at_end_of_backward.queue()

    def on_weight_grad(self, weight: ShardedWeight, grad_full: torch.Tensor) -> None:
        self.note_backward()
        if weight.recompute_holds:
            weight.recompute_holds -= 1
        if not weight.recompute_holds and _reshards_after_backward(weight):
            self.free(weight)
        if weight.add_grad(grad_full) and self.sync:
            if self.exact_gradients:  # every rank holds the global gradient: no reduction needed
                weight.keep_own_slice()
            elif weight.unit is not None and weight.unit.ready_to_reduce():
                self.reductions.launch(weight.unit)

    def on_replicated_grad(self, param: torch.Tensor) -> None:
        self.note_backward()

    # -- after backward ------------------------------------------------------------------------

    def finish(self) -> None:
        """Complete every reduction of this step and install the averaged gradients (run when a
        backward ends; a second call, such as the adapters' explicit one, does nothing)."""
        if not self.sync or not self.grad_pending:
            return  # inside no_sync() the sums wait for the first synchronised backward
        if self.exact is not None:
            self.exact.finish()
        for weight in self.weights:  # uses whose gradient never came (e.g. an unused output)
            if weight.has_unreduced_grad and self.exact_gradients:
                weight.keep_own_slice()
        for unit in self.units:
            if any(w.has_unreduced_grad for w in unit.members):
                self.reductions.launch(unit)
        self.reductions.all_reduce_replicated(self.replicated)
        self.reductions.wait_all()
        for weight in self.weights:
            weight.install_grad(self.world_size)
            if _reshards_after_backward(weight):
                self.free(weight)
        self.grad_pending = False

    def release(self) -> None:
        """Wait for and drop every collective still in flight; free every gathered weight."""
        self.reductions.wait_all()
        for weight in self.weights:
            weight.recompute_holds = 0
            self.free(weight)  # waits for a gather still writing it


def _reshards_after_backward(weight: ShardedWeight) -> bool:
    return weight.unit is None or weight.unit.reshard_after_backward


def _next_units(order: list[ShardedWeight]) -> list[ShardedWeight | None]:
    """For each position of ``order``, the first later weight of another unit (None: none)."""
    following: list[ShardedWeight | None] = [None] * len(order)
    for i in range(len(order) - 2, -1, -1):
        after = order[i + 1]
        following[i] = after if after.unit is not order[i].unit else following[i + 1]
    return following
