"""Problem (ddp_overlap_bucketed, spring 2025): DDP that all-reduces buckets of gradients.

Handout section 2.3.3: "organizing our parameters into buckets (reducing the number of total
communication calls) and all-reducing buckets when each of their constituent tensors are ready
(enabling us to overlap communication with computation)." A bucket is a list of parameters; when
the last of them has its gradient, their gradients are copied into one flat tensor, which is
all-reduced asynchronously; finish_gradient_synchronization waits for every bucket and copies
the averaged values back into the parameters' .grad.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

MB = 1024 * 1024  # bytes in a megabyte, read as 2^20


class DDPBucketed(nn.Module):
    def __init__(self, module: nn.Module, bucket_size_mb: float | None):
        """'Gradient synchronization should be bucketed, with each bucket holding at most
        bucket_size_mb of parameters.' None puts every gradient in one bucket."""
        super().__init__()
        if bucket_size_mb is not None and bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be > 0 (or None for one bucket), got {bucket_size_mb}")
        self.module = module
        self.world_size = dist.get_world_size()
        # "take care of broadcasting the weights before training": buffers included.
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)

        # "We suggest allocating parameters to buckets using the reverse order of
        # model.parameters(), since the gradients will become ready in approximately that order
        # during the backward pass." parameters() lists a tied weight once.
        cap = float("inf") if bucket_size_mb is None else bucket_size_mb * MB
        self.buckets: list[list[nn.Parameter]] = []
        bucket, bucket_bytes = [], 0
        for param in reversed([p for p in module.parameters() if p.requires_grad]):
            nbytes = param.numel() * param.element_size()
            if bucket and bucket_bytes + nbytes > cap:  # close it before it holds more than the cap
                self.buckets.append(bucket)
                bucket, bucket_bytes = [], 0
            bucket.append(param)  # a parameter larger than the cap gets a bucket of its own
            bucket_bytes += nbytes
        if bucket:
            self.buckets.append(bucket)

        self.bucket_of = {param: i for i, bucket in enumerate(self.buckets) for param in bucket}
        self._reset()
        for param in self.bucket_of:
            param.register_post_accumulate_grad_hook(self._on_gradient_ready)

    def _reset(self) -> None:
        """Before each step's backward: no gradient ready, nothing in flight."""
        self.waiting = [len(bucket) for bucket in self.buckets]  # gradients each bucket still needs
        self.in_flight: list[tuple[torch.Tensor, dist.Work] | None] = [None] * len(self.buckets)

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        # Autograd calls this during backward once param.grad is final for this backward.
        i = self.bucket_of[param]
        self.waiting[i] -= 1
        if self.waiting[i] == 0:  # "all-reducing buckets when each of their constituent tensors are ready"
            flat = _flatten_dense_tensors([p.grad for p in self.buckets[i]])  # a new tensor: one copy
            flat.div_(self.world_size)  # the sum of the ranks' shares is then their average
            self.in_flight[i] = (flat, dist.all_reduce(flat, async_op=True))

    def forward(self, *inputs, **kwargs):
        self._reset()  # a new step: forget a backward whose gradients were never finished
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """'When called, wait for asynchronous communication calls to be queued on GPU', then
        write each bucket's averaged gradients back where the optimizer reads them."""
        unlaunched = [i for i, work in enumerate(self.in_flight) if work is None]
        for i, work in enumerate(self.in_flight):
            if work is not None:
                work[1].wait()  # every rank waits for what it launched before saying anything
        if unlaunched:
            # A layer no rank used leaves its bucket unlaunched everywhere, so every rank raises
            # here alike; one used by some ranks only would hang the others (the library handles
            # both: writeup/details/from_answer_to_library.md).
            i = unlaunched[0]
            raise RuntimeError(
                f"bucket {i} was never all-reduced: {self.waiting[i]} of its {len(self.buckets[i])} "
                "parameters got no gradient in this backward (a parameter forward did not use?); "
                "this answer needs every trainable parameter to take part in every backward")
        for bucket, (flat, _) in zip(self.buckets, self.in_flight):
            grads = [p.grad for p in bucket]
            for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(averaged)
        self._reset()
