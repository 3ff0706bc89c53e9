"""Starting ranks and their process groups: spawned on this machine, under torchrun, or on SLURM.

* context.py  RankContext; device, backend and thread choices, checked before anything starts
* env.py      joining a process group from torchrun-style variables, and leaving it
* spawn.py    launch(): spawn ranks here; run_ranks(): spawn, or be one rank of a launcher;
              run_setting(): a benchmark's ranks from its setting
* pool.py     RankPool: ranks spawned once, many runs over one process group (the tests' pools)
* signals.py  SIGTERM/SIGINT stop every rank; ranks die with their launcher
* lifetime.py why finished gloo ranks aborted at exit; a group freed at teardown; exit_rank()
* slurm.py    running a script as the ranks of a SLURM job (submitit)
"""

from cs336_systems.launch.context import (
    DEFAULT_TIMEOUT_S,
    RankContext,
    backend_for_device,
    check_devices,
    cpu_threads_per_rank,
    default_device_type,
    find_free_port,
    is_shared_gpu,
)
from cs336_systems.launch.env import (
    init_from_env,
    launched_world_size,
    ranks_on_this_node,
    running_under_launcher,
    teardown,
)
from cs336_systems.launch.lifetime import exit_rank, gloo_workers_alive
from cs336_systems.launch.signals import Interrupted
from cs336_systems.launch.spawn import RankFailedError, launch, run_ranks, run_setting
