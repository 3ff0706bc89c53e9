"""Fully sharded data parallelism (FSDP; ZeRO stage 3), from scratch.

Every rank keeps 1/world_size of each Linear and Embedding weight; a layer's full weight exists
only while the layer computes, forward and backward, and its gradient is reduce-scattered back
to the shards as soon as backward produces it.

* sharded_weight.py  one weight's shard layout (flatten, pad, slice) and its collectives
* schedule.py        when they run: gather, prefetch, free, reduce-scatter, finish
* wrapper.py         ``FullyShardedDataParallel``: checks, rank 0's broadcast, hooks
"""

from cs336_systems.fsdp.schedule import MAX_REDUCTIONS_IN_FLIGHT, Schedule
from cs336_systems.fsdp.sharded_weight import ShardedWeight, ShardLayout
from cs336_systems.fsdp.wrapper import COMPUTE_DTYPES, SHARDED_TYPES, FullyShardedDataParallel

__all__ = [
    "COMPUTE_DTYPES",
    "MAX_REDUCTIONS_IN_FLIGHT",
    "SHARDED_TYPES",
    "FullyShardedDataParallel",
    "Schedule",
    "ShardLayout",
    "ShardedWeight",
]
