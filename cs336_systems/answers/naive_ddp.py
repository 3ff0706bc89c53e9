"""Problem (naive_ddp): data parallelism that all-reduces each gradient after backward.

Handout section 5.2, step by step:
  0. "We use the broadcast collective communication operation to send the model parameters
     from rank 0 to all other ranks."
  1-2. each rank runs forward and backward on its n/d examples (the caller's loop);
  3. "use the all-reduce collective communication operation to average the gradients";
  4. each rank steps its own optimizer, which stays in sync because its inputs are equal.
"""

import torch
import torch.distributed as dist
from torch import nn


class NaiveDDP(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        # Step 0. state_dict() covers buffers too (a BatchNorm's running statistics), so every
        # rank starts from rank 0's model, not only from its parameters. Its tensors share
        # storage with the module's, so the broadcast writes into the model itself.
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Step 3, after loss.backward() and before optimizer.step()."""
        world_size = dist.get_world_size()
        # parameters() yields a weight shared by two layers once, so it is reduced once.
        for param in self.module.parameters():
            if param.grad is not None:  # frozen parameters have no gradient to average
                # gloo has no ReduceOp.AVG: sum, then divide by the number of ranks.
                dist.all_reduce(param.grad)
                param.grad.div_(world_size)
