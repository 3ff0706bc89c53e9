"""Run any of this repo's scripts as a multi-rank job on SLURM, through submitit.

SLURM starts one *task* per rank (``--nodes`` x ``--tasks-per-node``; on GPUs one task per
GPU). Each task runs :func:`run_script_as_rank`, which turns submitit's view of the job into
the torchrun-style variables that :func:`cs336_systems.launch.run_ranks` reads, then
runs the target script in-process as if it had been started with ``python script args``. The
script therefore runs as one rank per task, exactly as it would under ``torchrun``.

Variables each task sets (``submitit.JobEnvironment`` supplies the facts):

* ``RANK`` (global rank), ``LOCAL_RANK`` (rank on this node; picks the GPU),
  ``WORLD_SIZE`` (tasks in the job), ``LOCAL_WORLD_SIZE`` (tasks per node);
* ``MASTER_ADDR``: the job's first host, where rank 0 runs (SLURM gives task 0 to the first
  node of the allocation), so every task names the same rendezvous host;
* ``MASTER_PORT``: derived from the job id, so every task of a job agrees without talking to
  the others, and jobs sharing a node usually differ. A ``MASTER_PORT`` already in the task's
  environment wins (``sbatch`` exports the submitting shell's environment by default, so
  ``MASTER_PORT=29555 python scripts/submit_slurm.py ...`` pins it).

Multi-node use: ask for ``--nodes N --gpus-per-node G``; tasks per node default to G, so the
world size is N x G. The nodes must reach the first node's ``MASTER_PORT`` over TCP, and
NCCL/gloo must pick a network interface that connects them: if the default is wrong, set
``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` (e.g. to the cluster's InfiniBand or ethernet
interface) in the shell that submits. Logs land in ``<folder>/<job id>_<task>_log.{out,err}``.

``cluster="local"`` runs the same tasks as subprocesses of this machine (one node only),
and ``cluster="debug"`` runs one task inside the submitting process: both test the path
without a cluster.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit

from cs336_systems import cli

# Ports below 1024 need root; Linux hands out 32768-60999 to outgoing connections (the
# ip_local_port_range default), so a fixed port there could be taken by any client socket.
# Derived ports stay between the two.
PORT_RANGE = (15_000, 30_000)


@dataclass(frozen=True)
class SlurmJobSpec:
    """What to ask SLURM for (each field is a flag of scripts/submit_slurm.py)."""

    nodes: int = field(default=1, metadata=cli.count("machines in the allocation", maximum=cli.MAX_RANKS))
    gpus_per_node: int = field(default=0, metadata=cli.count("GPUs per machine; 0 for CPU jobs", minimum=0, maximum=64))
    tasks_per_node: int | None = field(default=None, metadata=cli.count(
        "ranks per machine (default: --gpus-per-node, or 1 without GPUs)", maximum=cli.MAX_RANKS))
    cpus_per_task: int | None = field(default=None, metadata=cli.count(
        "CPU cores per rank (default: the cluster's)", maximum=1024))
    partition: str | None = field(default=None, metadata=cli.option(
        "SLURM partition (default: the cluster's)", cli.NAME))
    time_min: int = field(default=60, metadata=cli.count("wall-clock limit of the job, minutes", maximum=60 * 24 * 30))
    folder: str | Path = field(default="slurm_logs", metadata=cli.option("submitit's logs and pickles", cli.OutputFolder()))
    cluster: str | None = field(default=None, metadata=cli.choice(
        "run without SLURM: 'local' subprocesses or 'debug' in this process (default: SLURM)", ("local", "debug")))
    name: str = field(default="cs336-ddp", metadata=cli.option("job name shown by squeue", cli.NAME))

    @property
    def ranks_per_node(self) -> int:
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        return self.gpus_per_node if self.gpus_per_node > 0 else 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def validate(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be >= 0, got {self.gpus_per_node}")
        if self.ranks_per_node < 1:
            raise ValueError(f"tasks_per_node must be >= 1, got {self.ranks_per_node}")
        if self.time_min < 1:
            raise ValueError(f"time_min must be >= 1, got {self.time_min}")
        if self.cluster in ("local", "debug") and self.nodes != 1:
            raise ValueError(f"the {self.cluster!r} executor runs on this machine only; got nodes={self.nodes}")
        if self.cluster == "debug" and self.ranks_per_node != 1:
            raise ValueError(
                f"the 'debug' executor runs a single task in this process; got {self.ranks_per_node} "
                "tasks per node (use cluster='local' for several)"
            )


def master_port_for_job(job_id: str) -> int:
    """A port in :data:`PORT_RANGE` that every task of job ``job_id`` computes alike.

    Uses CRC-32, not ``hash()``: Python salts string hashes per process, so tasks would disagree.
    """
    low, high = PORT_RANGE
    return low + zlib.crc32(job_id.encode()) % (high - low)


def rank_environment(env: Any) -> dict[str, str]:
    """The torchrun-style variables for the task described by a ``submitit.JobEnvironment``."""
    tasks_per_node = env.num_tasks // env.num_nodes
    port = os.environ.get("MASTER_PORT") or str(master_port_for_job(str(env.job_id)))
    return {
        "RANK": str(env.global_rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.num_tasks),
        "LOCAL_WORLD_SIZE": str(tasks_per_node),
        "MASTER_ADDR": env.hostnames[0],
        "MASTER_PORT": port,
    }


def exit_code(error: SystemExit) -> int:
    """The process exit status ``sys.exit(code)`` would have given."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)  # sys.exit("message") prints it and exits with 1
    return 1


def run_script_as_rank(script: str, args: list[str]) -> int:
    """Body of each task: set this rank's variables and run ``script`` as ``__main__``.

    Returns the script's exit status (0 when it returns without calling ``sys.exit``).
    """
    # submitit lets SIGTERM pass (it waits for SLURM's SIGKILL, to checkpoint first); these
    # scripts keep no checkpoint, so a cancelled or timed-out task ends at once, as it does
    # under torchrun.
    previous_sigterm = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rank_env = rank_environment(submitit.JobEnvironment())
    saved_env = {name: os.environ.get(name) for name in rank_env}
    os.environ.update(rank_env)
    saved_argv, saved_path = sys.argv, list(sys.path)
    # As `python script.py` would: argv[0] is the script and its folder comes first on the path.
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return exit_code(e)
    finally:
        # Matters only for cluster="debug", where the task runs inside the submitting process.
        sys.argv, sys.path[:] = saved_argv, saved_path
        signal.signal(signal.SIGTERM, previous_sigterm)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0


def submit_script(spec: SlurmJobSpec, script: str | Path, args: list[str]) -> submitit.Job:
    """Submit ``script args`` as one job of ``spec.world_size`` tasks; returns at once."""
    spec.validate()
    path = Path(script).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"script to run not found: {script}")
    executor = submitit.AutoExecutor(folder=spec.folder, cluster=spec.cluster)
    parameters: dict[str, Any] = dict(
        name=spec.name,
        nodes=spec.nodes,
        tasks_per_node=spec.ranks_per_node,
        timeout_min=spec.time_min,
    )
    if spec.gpus_per_node:
        parameters["gpus_per_node"] = spec.gpus_per_node
    if spec.cpus_per_task is not None:
        parameters["cpus_per_task"] = spec.cpus_per_task
    if spec.partition is not None:
        parameters["slurm_partition"] = spec.partition
    executor.update_parameters(**parameters)
    return executor.submit(run_script_as_rank, str(path), list(args))


def wait_for_exit_codes(job: submitit.Job) -> list[int]:
    """Block until every task ends; one exit status per task (raises if a task raised)."""
    return [int(code) for code in job.results()]


def log_paths(job: submitit.Job) -> list[Path]:
    """Each task's stdout log (stderr sits beside it, ending in ``.err``)."""
    return [job.task(i).paths.stdout for i in range(job.num_tasks)]
