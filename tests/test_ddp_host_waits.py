"""No DDP variant makes the host wait for the device during a steady-state training step.

torch's DDP makes no host-device synchronisation per step; on a GPU each one drains the
queue of kernels and stops communication overlapping backward (tests/host_waits.py says what
counts as one). Without a GPU the step runs on the meta device under a counter, over torch's
``fake`` process group (world size 2, this process is rank 0); with a GPU, the same step runs
for real on one rank with NCCL under ``torch.cuda.set_sync_debug_mode("error")``, which raises
on any synchronisation.

A rank that lacks some gradient (a branch its data did not take) must learn whether another
rank has it; that read is allowed once per step, as torch pays one with
``find_unused_parameters=True``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import adapters
from cs336_systems.ddp import BucketedDDP
from cs336_basics.model import TransformerLM, model_config
from cs336_systems.launch import RankContext, launch
from tests.host_waits import HostWaitCounter

pytestmark = pytest.mark.problem("beyond")

WORLD_SIZE = 2

# Every variant through the adapters, and the bucketed levers that change its step path.
WRAPPERS = {
    "naive": adapters.get_ddp_naive,
    "flat": adapters.get_ddp_flat,
    "per-parameter": adapters.get_ddp_individual_parameters,
    "bucketed-1MB": lambda m: adapters.get_ddp_bucketed(m, 1.0),
    "bucketed-25MB": lambda m: adapters.get_ddp_bucketed(m, 25.0),
    "bucketed-one": lambda m: adapters.get_ddp_bucketed(m, None),
    "bucketed-no-views": lambda m: BucketedDDP(m, 0.05, gradient_as_bucket_view=False),
    "bucketed-bf16": lambda m: BucketedDDP(m, 0.05, comm_dtype=torch.bfloat16),
}


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Branchy(nn.Module):
    """A trunk and two heads; ``head_b`` only runs when asked, so its gradient can be missing."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.head_a = nn.Linear(16, 4)
        self.head_b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = F.relu(self.trunk(x))
        return self.head_a(h) + self.head_b(h) if use_b else self.head_a(h)


def _lm_step(ddp: nn.Module, optimizer, tokens: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    logits = ddp(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    ddp.finish_gradient_synchronization()
    optimizer.step()


def _waits_per_step(ddp: nn.Module, step, steps: int = 2) -> list[dict[str, int]]:
    with HostWaitCounter(WORLD_SIZE):
        step()  # the first step settles the launch order (a one-time read): not steady state
    counts = []
    for _ in range(steps):
        with HostWaitCounter(WORLD_SIZE) as counter:
            step()
        counts.append(dict(counter.waits))
    return counts


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_a_step_in_which_every_gradient_exists_never_waits(fake_group, name):
    with torch.device("meta"):
        module = TransformerLM(model_config("tiny"))
        tokens = torch.randint(0, module.config.vocab_size, (4, 17))
    ddp = WRAPPERS[name](module)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    assert _waits_per_step(ddp, lambda: _lm_step(ddp, optimizer, tokens)) == [{}, {}]


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_a_missing_gradient_costs_at_most_one_wait_per_step(fake_group, name):
    with torch.device("meta"):
        module = Branchy()
        x = torch.randn(6, 8)
    ddp = WRAPPERS[name](module)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def step():
        optimizer.zero_grad(set_to_none=True)
        ddp(x, use_b=False).sum().backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()

    for waits in _waits_per_step(ddp, step):
        assert sum(waits.values()) <= 1, waits


def test_the_counter_sees_a_read_of_device_memory(fake_group):
    """The counter can fail: a hook that reads a gradient's norm is one wait per parameter."""
    with torch.device("meta"):
        module = Branchy()
        x = torch.randn(6, 8)
    ddp = adapters.get_ddp_individual_parameters(module)
    def read_norm(param: torch.Tensor) -> None:
        param.grad.norm().item()

    for p in module.parameters():
        p.register_post_accumulate_grad_hook(read_norm)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def step():
        optimizer.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()

    [first, _] = _waits_per_step(ddp, step)
    assert first == {"outside cs336_systems": len(list(module.parameters()))}


def test_the_counter_sees_host_data_copied_in_when_backward_ends(fake_group):
    """The counter can fail inside backward too, where the wrappers now reduce: host data copied
    to the device by a callback queued for the end of backward is one wait."""
    with torch.device("meta"):
        module = Branchy()
        x = torch.randn(6, 8)

    def copy_in() -> None:
        torch.tensor([1.0, 2.0], device="meta")

    def queue_copy(param: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(copy_in)

    module.trunk.bias.register_post_accumulate_grad_hook(queue_copy)
    with HostWaitCounter(WORLD_SIZE) as counter:
        module(x).sum().backward()
    assert counter.total == 1, counter.waits


def _steps_under_sync_error_mode(ctx: RankContext, names: list[str]) -> dict[str, str]:
    """Rank function on one GPU: each wrapper trains 2 steps, then 2 more with any
    synchronisation raising; returns the error (or "") per wrapper."""
    torch.manual_seed(0)
    module = TransformerLM(model_config("tiny")).to(ctx.device)
    tokens = torch.randint(0, module.config.vocab_size, (4, 17), device=ctx.device)
    outcome = {}
    for name in names:
        ddp = WRAPPERS[name](module)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        for _ in range(2):
            _lm_step(ddp, optimizer, tokens)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                _lm_step(ddp, optimizer, tokens)
            outcome[name] = ""
        except RuntimeError as e:
            outcome[name] = str(e).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode(0)
            ddp.detach()
    return outcome


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(300)
def test_on_a_gpu_no_step_synchronises():
    [outcome] = launch(
        _steps_under_sync_error_mode, 1, args=(list(WRAPPERS),), backend="nccl", device_type="cuda"
    )
    assert outcome == {name: "" for name in WRAPPERS}
