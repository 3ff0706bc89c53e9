"""Problem (optimizer_state_sharding): each rank keeps the optimizer state of its own parameters.

Handout section 6: "each rank's optimizer instance will only handle a subset of the parameters
(approximately 1 / world_size). When each rank's optimizer takes an optimizer step, it'll only
update the subset of model parameters in its shard. Then, each rank will broadcast its updated
parameters to the other ranks to ensure that the model parameters remain synchronized after each
optimizer step."
"""

from typing import Any

import torch
import torch.distributed as dist


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.owner: dict[torch.Tensor, int] = {}  # every parameter -> the rank that steps it
        self.bytes_owned = [0] * self.world_size
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs
        self.local: torch.optim.Optimizer | None = None  # the wrapped optimizer, over our shard only
        # "Make sure to call the torch.optim.Optimizer super-class constructor in this method":
        # it calls add_param_group once per group, which shards them.
        super().__init__(params, kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """'called during construction ... and may also be called during training (e.g., for
        gradually unfreezing layers in a model). As a result, this method should handle
        assigning the model's parameters among the ranks.'"""
        super().add_param_group(param_group)  # fills in the defaults, refuses duplicates
        group = self.param_groups[-1]
        for param in group["params"]:
            # The rank with the fewest bytes so far: about 1/world_size of the state each, and
            # the same choice on every rank (same parameters, same order, no communication).
            owner = min(range(self.world_size), key=lambda r: self.bytes_owned[r])
            self.owner[param] = owner
            self.bytes_owned[owner] += param.numel() * param.element_size()
        # Our group keeps the group's hyperparameters (its own lr, say) and only our parameters;
        # a rank that owns none of them keeps an empty group, so groups stay aligned by index.
        mine = {**group, "params": [p for p in group["params"] if self.owner[p] == self.rank]}
        if self.local is None:
            self.local = self.optimizer_cls([mine], **self.kwargs)
        else:
            self.local.add_param_group(mine)

    def step(self, closure=None, **kwargs):
        """'Calls the wrapped optimizer's step() method with the provided closure and keyword
        arguments. After updating the parameters, synchronize with the other ranks.'"""
        # A learning-rate scheduler changes self.param_groups; our shard steps with its values.
        for group, mine in zip(self.param_groups, self.local.param_groups):
            mine.update({key: value for key, value in group.items() if key != "params"})
        loss = self.local.step(closure, **kwargs)
        # Each parameter's new value comes from the one rank that stepped it.
        for param, owner in self.owner.items():
            dist.broadcast(param.data, src=owner)
        return loss
