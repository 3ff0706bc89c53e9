"""Problem (ddp_overlap_individual_parameters): DDP whose all-reduces overlap backward.

Handout section 5.3.2: "we can all-reduce parameter gradients as soon as they're ready, reducing
the overhead of data parallel training by overlapping computation of the backward pass with
communication of gradients." Two tools make it: a hook that runs when a parameter's gradient has
been accumulated (``register_post_accumulate_grad_hook``), and asynchronous collectives
(``async_op=True``) that return a handle to wait on later.
"""

import torch
import torch.distributed as dist
from torch import nn


class DDPIndividualParameters(nn.Module):
    def __init__(self, module: nn.Module):
        """'Given an instantiated PyTorch nn.Module to be parallelized, construct a DDP container
        that will handle gradient synchronization across ranks.'"""
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.handles: list[dist.Work] = []
        # "take care of broadcasting the weights before training (so all ranks have the same
        # initial parameters)": the state dict shares storage with the module, buffers included.
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)
        # parameters() yields a weight tied between two layers once: its hook fires once per
        # backward, after both uses have accumulated into .grad.
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._all_reduce_when_ready)

    def _all_reduce_when_ready(self, param: nn.Parameter) -> None:
        # Called by autograd during backward, as soon as this gradient is final. Dividing first
        # makes the sum of the ranks' gradients their average (gloo has no ReduceOp.AVG).
        param.grad.div_(self.world_size)
        # "asynchronous calls will return a distributed request handle": backward goes on
        # computing the earlier layers' gradients while this one travels.
        self.handles.append(dist.all_reduce(param.grad, async_op=True))

    def forward(self, *inputs, **kwargs):
        """'Calls the wrapped module's forward() method with the provided positional and keyword
        arguments.'"""
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """'When called, wait for asynchronous communication calls to finish on the GPU':
        called after loss.backward(), before optimizer.step() reads the averaged gradients."""
        for handle in self.handles:
            handle.wait()
        self.handles.clear()
