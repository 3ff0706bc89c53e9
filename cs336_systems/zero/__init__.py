"""Optimizer state sharding (ZeRO stage 1): each rank keeps the optimizer state of its shard only.

What is sharded. Data-parallel ranks hold identical copies of the parameters, the gradients and
the optimizer state. ZeRO (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", Sec. 5.1) notes that the optimizer state need not be
replicated: stage 1 ("P_os") gives every parameter one *owner* rank, which alone keeps that
parameter's state and alone runs the optimizer update for it. Parameters and gradients stay
replicated; only the optimizer state is divided.

Memory. Let P be the number of parameters. Training in fp32 with Adam keeps 4P bytes of
parameters, 4P of gradients and 8P of optimizer state (two moments) per rank: 16P. Sharded over
n ranks the state costs about 8P/n, for 8P + 8P/n in all (a rank's shard exceeds the average
by at most the largest parameter, see :func:`assign_to_ranks`), plus one bucket of transient
buffer during the broadcasts. In the paper's mixed-precision accounting (K = 12 bytes of state
per parameter) stage 1 lowers 16P to 4P + 12P/n, e.g. 120 GB to 31.4 GB for a 7.5B-parameter
model on 64 ranks (paper, Fig. 1).

Communication. Let B be the parameter bytes. DDP's ring all-reduce of the gradients sends and
receives 2(n-1)/n * B per rank per step. This sharded optimizer adds the parameter broadcasts:
each rank receives every parameter it does not own, about (n-1)/n * B per step, the volume of
an all-gather. Composed with a DDP that all-reduces full gradients, a step thus moves about
3(n-1)/n * B per rank, 1.5x DDP. The paper's ZeRO-1 instead reduce-scatters the gradients (each
owner needs only its own) and all-gathers the parameters, (n-1)/n * B each, which is exactly
DDP's volume (paper, Sec. 7.2.1); that requires the gradient reduction to know the sharding,
which the DDP wrappers of this repo do not.

Modules:

* assignment.py  which rank owns which parameter (greedy, balanced by bytes)
* optimizer.py   :class:`ShardedOptimizer`: the local optimizer over the owned shard and the step
* broadcast.py   the step's broadcasts of updated parameters: large ones in place, small ones
  packed, all in flight at once
* checkpoint.py  its state dicts: one shard per rank, or the whole state in torch's format
"""

from cs336_systems.zero.assignment import assign_to_ranks, parameter_bytes
from cs336_systems.zero.checkpoint import STATE_DICT_FORMAT
from cs336_systems.zero.optimizer import ShardedOptimizer
