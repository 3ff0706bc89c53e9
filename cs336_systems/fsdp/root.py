"""The root of a sharded model: one schedule over every unit under it, and its forward's context.

Whichever way a model was sharded (the wrapper with the handout's Linear/Embedding sharding, the
wrapper with every parameter sharded, or ``fully_shard`` applied per block and then to the
model), one :class:`Root` drives it, as ``fully_shard``'s root state drives every FSDP module
under it. Its forward context:

* refuses to start while a backward's reductions are unfinished (only possible when a backward
  was cut short: the schedule finishes every synchronised backward itself, schedule.py);
* swaps views of gathered weights that autograd saves for markers (schedule.py ``pack``);
* casts floating inputs to the compute dtype, as ``MixedPrecisionPolicy(param_dtype=...,
  cast_forward_inputs=True)`` does; ``cast_forward_inputs=False`` leaves them as given.
  Outputs are left in the dtype the model computed them in (``output_dtype=None``, torch's
  default).

``Root.active`` is the root whose forward is under way: a unit's forward pre-hook that finds
none is the root's own (``fully_shard``'s lazy root, composable.py).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, ClassVar, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map_only

from cs336_systems.fsdp.options import FsdpOptions
from cs336_systems.fsdp.schedule import Schedule
from cs336_systems.fsdp.unit import Unit

_live_roots: weakref.WeakSet[Root] = weakref.WeakSet()
_step_guard: torch.utils.hooks.RemovableHandle | None = None


def _refuse_step_before_finish(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Global optimizer pre-step hook: no step on shards whose gradients are still in flight
    (a backward that never ended: the schedule finishes every one that does)."""
    for root in list(_live_roots):
        if root.schedule.grad_pending and root.owns_any(optimizer):
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() on FSDP parameters whose gradients are still "
                "being reduced: the backward that produced them did not end; call "
                "fsdp_model.finish_gradient_synchronization() before the optimizer step"
            )


def cast_floats(value: Any, dtype: torch.dtype | None) -> Any:
    """Every floating tensor in ``value`` (nested tuples, lists, dicts) cast to ``dtype``."""
    if dtype is None:
        return value
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)


class Root:
    """One schedule for every unit of a sharded model, and the context of its forward."""

    active: ClassVar[Root | None] = None

    def __init__(self, module: nn.Module, units: list[Unit], replicated: list[nn.Parameter],
                 options: FsdpOptions, compute_dtype: torch.dtype | None,
                 exact_gradients: bool = False):
        _, replicate_group = options.groups()
        self.module = module
        self.world_size = dist.get_world_size()
        self.schedule = Schedule(units, replicated, self.world_size, group=None,
                                 exact_gradients=exact_gradients,
                                 reshard_after_forward=options.reshard_after_forward,
                                 reduce_dtype=options.reduce_in, replicate_group=replicate_group)
        self.cast_to = compute_dtype if options.cast_forward_inputs else None
        self._saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._param_ids = {id(p) for p in module.parameters()}
        global _step_guard
        _live_roots.add(self)
        if _step_guard is None:
            _step_guard = register_optimizer_step_pre_hook(_refuse_step_before_finish)

    @property
    def weights(self):
        return self.schedule.weights

    def hook_replicated(self) -> None:
        """Each replicated parameter's gradient, once accumulated, tells the schedule a backward
        is under way (it all-reduces them when the backward ends)."""
        for p in self.schedule.replicated:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.schedule.on_replicated_grad)

    def owns_any(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"])

    # -- forward -------------------------------------------------------------------------------

    @torch.compiler.disable
    def enter(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Start a forward; returns the inputs cast to the compute dtype."""
        if self.schedule.grad_pending:
            raise RuntimeError(
                "forward started while the previous backward's gradient reductions were never "
                "finished (its backward did not end): call fsdp_model.finish_gradient_synchronization() "
                "before the next forward"
            )
        hooks = torch.autograd.graph.saved_tensors_hooks(self.schedule.pack, self.schedule.unpack)
        hooks.__enter__()
        self._saved_hooks = hooks
        self.schedule.begin_forward()
        Root.active = self
        return cast_floats(args, self.cast_to), cast_floats(kwargs, self.cast_to)

    @torch.compiler.disable
    def exit(self) -> None:
        hooks, self._saved_hooks = self._saved_hooks, None
        Root.active = None
        try:
            self.schedule.end_forward()
        finally:
            if hooks is not None:
                hooks.__exit__(None, None, None)

    # -- what users call -----------------------------------------------------------------------

    def finish(self) -> None:
        self.schedule.finish()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self.schedule.sync
        self.schedule.sync = False
        try:
            yield
        finally:
            self.schedule.sync = previous

    @torch.no_grad()
    def gather_full_params(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter of ``module`` by name, full (a collective: all ranks call)."""
        by_shard = {id(w.param): w for w in self.weights}
        full: dict[str, torch.Tensor] = {}
        for name, p in module.named_parameters():
            weight = by_shard.get(id(p))
            if weight is None:
                full[name] = p.detach().clone()
                continue
            padded = torch.empty(weight.layout.padded_numel, dtype=p.dtype, device=p.device)
            dist.all_gather_into_tensor(padded, weight.shard.detach(), group=weight.group)
            full[name] = weight.layout.unflatten(padded)
        return full


def units_under(module: nn.Module) -> list[Unit]:
    """Every unit in ``module``'s subtree, in the order ``modules()`` visits them (every rank's)."""
    return [u for m in module.modules() if "_fsdp_units" in m.__dict__ for u in m._fsdp_units]


def adopt(root: Root, module: nn.Module) -> None:
    """Every unit module under ``module`` belongs to ``root`` (its hooks find it there)."""
    for m in module.modules():
        if "_fsdp_call" in m.__dict__:
            m.__dict__["_fsdp_owner_root"] = root


def root_of(module: nn.Module) -> Root:
    """The root that drives a ``fully_shard`` module: the one it belongs to, or (a module's first
    use with no root) a new one rooted at it, over every unit under it, as torch's lazy root."""
    root = module.__dict__.get("_fsdp_owner_root")
    if root is None:
        options: FsdpOptions = module.__dict__["_fsdp_options"]
        if not module.__dict__.get("_fsdp_reshard_set"):
            # The root's own parameters stay until backward, as torch's root's, unless the user
            # chose otherwise (set_reshard_after_forward, as torch's _auto_reshard_after_forward).
            module._fsdp_call.reshard = False
        # Each module's own reshard_after_forward (its Call's flag) decides, as per module in torch.
        root = Root(module, units_under(module), [], replace(options, reshard_after_forward=True),
                    module.__dict__["_fsdp_compute_dtype"])
        adopt(root, module)
    return root
