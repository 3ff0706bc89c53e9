"""What every DDP variant shares: construction, the forward pass, buffers, ``no_sync``, unused parameters.

Data parallelism keeps one full replica of the model per rank, gives each rank a different
shard of the batch, and averages gradients across ranks before the optimizer step, so every
replica takes the same step as single-process training on the whole batch would.

At construction every variant

* checks its arguments before issuing any collective (a bad call fails on its own rank with a
  ValueError or TypeError instead of leaving the other ranks blocked in a broadcast);
* broadcasts rank 0's parameters *and buffers*, so replicas start identical even when ranks
  were seeded differently;
* lists the parameters it synchronises: ``module.parameters()`` already yields a tied weight
  once (so it is reduced once), and frozen parameters (``requires_grad=False``) get no
  gradient, so they are skipped.

Buffers (BatchNorm's running statistics, say) are not gradients: each rank updates its own in
forward. As torch's DDP does with its default ``broadcast_buffers=True``, rank 0's buffers are
broadcast at the start of a forward, so every rank computes with rank 0's; like torch, this is
skipped for the forward that follows a forward run under ``no_sync()`` or without grad
(``torch.nn.parallel.DistributedDataParallel._pre_forward``), and when there are no buffers.

Unused parameters: a parameter may get no gradient on some ranks (a branch not taken for this
rank's data). Single-process training on the whole batch would give it the gradient of the
ranks that did use it, and leave it ``None`` only if no rank did (optimizers skip ``None``
gradients, so a zero gradient would wrongly apply weight decay). Each variant therefore
learns, with the same communication on every rank, how many ranks produced each gradient:
missing local gradients count as zeros, and a gradient stays ``None`` only where that count
is zero everywhere. Only a rank that lacks some gradient needs to read that count, so a step
in which every rank has every gradient never waits for the device. So ours need no
``find_unused_parameters=True``; given torch's ``find_unused_parameters=False``, a parameter whose
hook did not fire in a synchronised backward makes the next forward raise, naming it, as torch's
DDP does (a host-side set of fired hooks: no device wait).

When gradients are reduced: as torch's DDP does, when the backward pass of a synchronised
forward ends, with no call needed. A post-accumulate-grad hook on every synchronised parameter
marks the backward as under way; the first one of a backward queues the reduction with
autograd's engine (comm/end_of_backward.py: ``queue_callback``, what torch's reducer does in
``mark_variable_ready`` and our FSDP in schedule.py), which runs it after the last gradient
of that backward is accumulated, before ``backward()`` returns. So code written for torch's DDP
(backward, then ``optimizer.step()``) trains in step here too; ``finish_gradient_synchronization()``,
which the handout's adapters call, then finds nothing left to do. As in torch, hooks act only on a
backward of the wrapper's own forward, once: a second backward without a forward in between is
not reduced (torch's reducer ignores it too, ``expect_autograd_hooks_``).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.comm.coalesced import broadcast_coalesced
from cs336_systems.comm.end_of_backward import AtEndOfBackward
from cs336_systems.ddp.bucket import read_together
from cs336_systems.ddp.mean_all_reduce import MeanAllReduce
from cs336_systems.ddp.torch_keywords import resolve


def check_module(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of the module to wrap; TypeError, ValueError or RuntimeError if it cannot be."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module to wrap, got {type(module).__name__}")
    params = list(module.parameters())
    if not params:
        raise ValueError(
            f"{type(module).__name__} has no parameters: there is nothing to keep in sync"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "the default process group is not initialised: call "
            "cs336_systems.launch.init_from_env() (or launch()) before wrapping a model"
        )
    return params


class UsageCount:
    """Per synchronised parameter, how many ranks produced its gradient this step.

    The counts live in one device tensor, filled on the device (no host data is copied in)
    and all-reduced asynchronously; reading them back is the only host-device wait, and only
    a rank with a missing gradient needs to.
    """

    def __init__(self, params: Sequence[nn.Parameter]):
        # float32: the counts are small integers, exact in it, and every backend reduces it.
        self.counts = torch.zeros(len(params), dtype=torch.float32, device=params[0].device)
        self.work: dist.Work | None = None

    def start(self, missing: Sequence[int], comm: MeanAllReduce) -> None:
        """Launch the all-reduce; ``missing`` are the indices with no local gradient."""
        self.counts.fill_(1.0)
        for i in missing:
            self.counts[i].fill_(0.0)
        self.work = comm.sum(self.counts, async_op=True)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def read(self, indices: Sequence[int]) -> list[float]:
        """The counts at ``indices`` (waits for the all-reduce, then for the device: once)."""
        self.wait()
        return read_together([[self.counts[i] for i in indices]])[0]


class DataParallel(nn.Module):
    """Base of the DDP variants: wraps ``module`` (kept as ``.module``) and keeps replicas equal.

    Subclasses implement :meth:`_synchronize` (reduce this step's gradients), which runs when the
    backward of a synchronised forward ends, or at :meth:`finish_gradient_synchronization` if
    no gradient reached this rank's hooks; and may extend :meth:`_on_grad_ready`.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, *,
                 buckets: bool = False, **torch_keywords: Any):
        """``torch_keywords``: torch's ``DistributedDataParallel`` keywords (torch_keywords.py);
        ``buckets``: the subclass takes ``bucket_cap_mb`` and ``gradient_as_bucket_view`` itself."""
        params = check_module(module)
        keywords = resolve(type(self).__name__, params, process_group, buckets=buckets, **torch_keywords)
        process_group, broadcast_buffers = keywords.process_group, keywords.broadcast_buffers
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.comm = MeanAllReduce(process_group)
        self.world_size = self.comm.world_size
        self.rank = dist.get_rank(process_group)
        self.broadcast_buffers = broadcast_buffers
        # Parameters that receive gradients, in registration order, each once.
        self.synced_params: list[nn.Parameter] = [p for p in params if p.requires_grad]
        if not self.synced_params:
            raise ValueError(
                f"{type(module).__name__} has no parameter with requires_grad=True: "
                "there is no gradient to synchronise"
            )
        # Set by no_sync(); read at forward time, as torch's DDP does, so that a forward run
        # inside no_sync() marks its backward as local-only wherever backward() is called.
        self.require_backward_grad_sync = True
        self._sync_this_backward = True
        # torch's DDP calls this require_forward_param_sync: whether the last forward was a
        # synchronised one with grad, which is when the next forward broadcasts buffers.
        self._buffers_stale = True
        # Set by a synchronised forward, cleared once its gradients are reduced; hooks act only
        # while it is set (torch's reducer: expect_autograd_hooks_).
        self._awaiting_sync = False
        self._at_end_of_backward = AtEndOfBackward(self.finish_gradient_synchronization)
        self.allreduce_calls_last_step = 0
        self._param_names = {id(p): n for n, p in module.named_parameters()}
        # find_unused_parameters=False (torch's meaning): the synchronised parameters whose hook
        # did not fire in a synchronised backward are named by the next forward, as torch's is.
        self._refuse_unused = keywords.refuse_unused
        self._ready_ids: set[int] = set()  # ids of the parameters whose hook fired this backward
        self._unused_last_backward: list[str] = []
        self._src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        if keywords.init_sync:
            broadcast_coalesced(list(module.parameters()) + list(module.buffers()), src=self._src, group=process_group)
        # The hooks reach the wrapper through a weak reference: a parameter holds its hooks where
        # the garbage collector cannot follow, so a hook holding the wrapper would keep the
        # wrapper, the module and every gradient buffer alive after the last user reference.
        wrapper = weakref.ref(self)

        def on_grad_ready(param: torch.Tensor) -> None:
            alive = wrapper()
            if alive is not None and alive._awaiting_sync:
                alive._on_grad_ready(param)

        self._hook_handles = [p.register_post_accumulate_grad_hook(on_grad_ready) for p in self.synced_params]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_can_forward()
        self._before_forward()
        if self.broadcast_buffers and self._buffers_stale:
            self._broadcast_buffers()
        self._sync_this_backward = self._awaiting_sync = self.require_backward_grad_sync
        output = self.module(*args, **kwargs)
        self._buffers_stale = torch.is_grad_enabled() and self.require_backward_grad_sync
        return output

    def _broadcast_buffers(self) -> None:
        buffers = list(self.module.buffers())  # listed anew: a module may reassign a buffer
        if buffers:
            with torch.no_grad():
                broadcast_coalesced(buffers, src=self._src, group=self.process_group)

    def detach(self) -> None:
        """Stop acting on the module's backward passes (other wrappers may take over)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._awaiting_sync = False

    def release(self) -> None:
        """Let go of everything this wrapper holds for communication; call it before
        ``destroy_process_group()``, after the last step.

        Waits for any collective still in flight, then drops its work handles, the gradient
        buffers, the hooks on the module's parameters and the process group, so that
        destroying the group frees it and joins gloo's worker threads while Python is fully
        alive (cs336_systems/launch/lifetime.py says why that matters at exit). The module
        (``.module``) keeps its parameters and gradients; the wrapper cannot train afterwards.
        Calling it again does nothing.
        """
        if self.comm is None:
            return
        self._release_comm()
        self.detach()
        self.comm = None
        self.process_group = None

    def _release_comm(self) -> None:
        """Wait for and drop the variant's in-flight work and its buffers (subclasses)."""

    def _check_not_released(self) -> None:
        if self.comm is None:
            raise RuntimeError(
                f"this {type(self).__name__} was released (release()) and cannot synchronise "
                "gradients any more: wrap the module again to keep training"
            )

    def _before_forward(self) -> None:
        """Hook for subclasses that must check or reset per-step state."""

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes of forwards run inside this context
        skip communication; the first synchronised step afterwards reduces the sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """A gradient of a synchronised backward is final: the first of a backward queues the
        reduction to run when that backward ends (see the module docstring)."""
        self._at_end_of_backward.queue()
        self._ready_ids.add(id(param))

    def _check_can_forward(self) -> None:
        """Not released; and, with ``find_unused_parameters=False``, raise for the parameters the
        last synchronised backward left without a gradient on this rank, at the next forward, as
        torch's DDP does (its reducer finds the bucket it never finished there)."""
        self._check_not_released()
        unused, self._unused_last_backward = self._unused_last_backward, []
        if unused:
            shown = ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else "")
            raise RuntimeError(
                f"{type(self).__name__} was built with find_unused_parameters=False, but the last backward on rank "
                f"{self.rank} produced no gradient for {len(unused)} parameter(s): {shown}. As torch's "
                "DistributedDataParallel, it refuses to go on: use them in the loss, or pass "
                "find_unused_parameters=True if they are meant to go unused"
            )

    def finish_gradient_synchronization(self) -> None:
        """Reduce this step's gradients now if the backward has not already done so; otherwise
        (the usual case, and always inside ``no_sync()``) nothing. Kept for the handout's
        adapters and for a backward that reached no hook on this rank."""
        self._check_not_released()
        if not self._awaiting_sync:
            return
        self._awaiting_sync = False
        if self._refuse_unused:  # read on the host before the reduction resets the step's state
            self._unused_last_backward = [self._param_names.get(id(p), "?") for p in self.synced_params
                                          if id(p) not in self._ready_ids]
        self._ready_ids = set()
        self._synchronize()

    def _synchronize(self) -> None:
        """Reduce the gradients of the synchronised backward that just ended (subclasses)."""
        raise NotImplementedError

    def on_train_batch_start(self) -> None:
        """Called at the start of a training step; variants with per-step state reset it."""

    def _missing_grads(self) -> list[int]:
        """Indices into ``synced_params`` of the parameters with no local gradient."""
        return [i for i, p in enumerate(self.synced_params) if p.grad is None]
