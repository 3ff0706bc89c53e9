"""Activation checkpointing per layer, and how FSDP tells a recomputation from a forward.

``checkpoint_layers`` runs each selected layer (by default every element of every
``nn.ModuleList``: a Transformer's blocks) under ``torch.utils.checkpoint`` (non-reentrant): its
forward keeps only its inputs, and backward reruns it to rebuild what it would have saved. The
model is unchanged otherwise, so the same call serves our FSDP and torch's ``fully_shard``.

During that rerun the layer's Linear and Embedding calls fire FSDP's hooks again. They must
gather the weight (it was freed after the forward) but must not count a new use: the rerun's
autograd graph only supplies saved tensors to the original one, whose gradient is the one that
arrives. :func:`is_recomputing` says which case a hook is in; a recomputed layer keeps its
gathered weight until the original use's gradient arrives (schedule.py), because the tensors
the rerun saved are views of it.
"""

from __future__ import annotations

from typing import Callable

import torch.utils.checkpoint
from torch import nn

_recomputing = 0  # depth of recomputations under way (not thread-local: CUDA backward threads)


def is_recomputing() -> bool:
    """True while a checkpointed layer is being rerun in backward."""
    return _recomputing > 0


def _in_module_list(module: nn.Module) -> Callable[[nn.Module], bool]:
    members = {id(m) for lst in module.modules() if isinstance(lst, nn.ModuleList) for m in lst}
    return lambda m: id(m) in members


def _checkpointed(module: nn.Module, forward: Callable) -> Callable:
    def run(*args, **kwargs):
        calls = 0

        def body(*a, **k):
            global _recomputing
            nonlocal calls
            calls += 1
            if calls == 1:  # the forward itself
                return forward(*a, **k)
            _recomputing += 1
            # A unit whose forward hooks gather its parameters (every parameter sharded) is
            # rerun here without them: its hooks are called around the rerun instead.
            enter, leave = module.__dict__.get("_fsdp_recompute_hooks", (None, None))
            try:
                if enter is not None:
                    enter()
                try:
                    return forward(*a, **k)
                finally:
                    if leave is not None:
                        leave()
            finally:
                _recomputing -= 1

        return torch.utils.checkpoint.checkpoint(body, *args, use_reentrant=False, **kwargs)

    return run


def checkpoint_layers(module: nn.Module, select: Callable[[nn.Module], bool] | None = None) -> int:
    """Run every submodule ``select`` picks (default: the elements of ``nn.ModuleList``s) under
    activation checkpointing; returns how many. Idempotent: a layer is wrapped once."""
    select = select or _in_module_list(module)
    count = 0
    for m in module.modules():
        if select(m) and not getattr(m, "_fsdp_checkpointed", False):
            m.forward = _checkpointed(m, m.forward)
            m._fsdp_checkpointed = True
            count += 1
    return count
