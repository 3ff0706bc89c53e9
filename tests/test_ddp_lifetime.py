"""Dropping a DDP wrapper frees it and its module, as dropping torch's DDP does.

The overlapped wrappers install a hook on every parameter. A parameter keeps its hooks where
Python's garbage collector cannot see them, so a hook that held the wrapper would keep the
wrapper, the module and every bucket alive for the rest of the process: in a notebook or a
benchmark that rebuilds models, the device fills up (an xl model on one H100 ran out of
memory after four rebuilds before this was fixed). The reference is torch's own DDP, checked
in the same rank.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cs336_systems.ddp import AutoBucketedDDP
from cs336_systems.ddp.variants import VARIANTS
from cs336_systems.launch import RankContext, launch

pytestmark = pytest.mark.problem("beyond")

BUILDERS = {
    **{name: variant.build for name, variant in VARIANTS.items()},
    "bucketed-auto": lambda module: AutoBucketedDDP(module),
    "torch-ddp": DistributedDataParallel,
}


def _freed_after_a_step(ctx: RankContext) -> dict[str, tuple[bool, bool]]:
    freed = {}
    for name, build in BUILDERS.items():
        module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        wrapper = build(module)
        wrapper(torch.randn(4, 8)).sum().backward()
        if hasattr(wrapper, "finish_gradient_synchronization"):
            wrapper.finish_gradient_synchronization()
        module_ref, wrapper_ref = weakref.ref(module), weakref.ref(wrapper)
        del module, wrapper
        gc.collect()
        freed[name] = (module_ref() is None, wrapper_ref() is None)
    return freed


def test_dropping_a_wrapper_frees_it_and_its_module():
    [freed] = launch(_freed_after_a_step, 1, backend="gloo", device_type="cpu")
    assert freed["torch-ddp"] == (True, True), "the reference itself kept its module"
    assert {name: f for name, f in freed.items() if f != (True, True)} == {}
