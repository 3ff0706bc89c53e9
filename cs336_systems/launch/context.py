"""What a rank knows of its place in the job, and the choice of its device, backend and threads.

Vocabulary used across the repo: a *rank* is one process of the job, numbered 0..world_size-1;
the *world size* is the number of ranks; the *local rank* numbers the ranks of one node and
picks that rank's GPU; the *local world size* is the number of ranks on one node.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

# Long enough for a slow first collective on a loaded 2-core machine, short enough that a
# broken test fails well inside the suite's budget.
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RankContext:
    """What one rank knows about its place in the job."""

    rank: int  # global rank, 0..world_size-1
    world_size: int  # number of ranks in the job
    local_rank: int  # rank within this node; picks the GPU
    device: torch.device  # where this rank's model and data live
    backend: str  # "gloo" or "nccl"
    local_world_size: int = 1  # ranks on this rank's node (they share its cores and GPUs)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def shared_gpu(self) -> bool:
        """Whether this node's ranks take turns on fewer GPUs than there are ranks."""
        return is_shared_gpu(self.device.type, self.local_world_size)

    def share_cpu_threads(self) -> int:
        """On a CPU, give this rank its share of the node's cores (see :func:`cpu_threads_per_rank`)
        and return it; ranks of one node would otherwise each start a thread per core and contend."""
        threads = cpu_threads_per_rank(self.local_world_size)
        if self.device.type == "cpu":
            torch.set_num_threads(threads)
        return threads


def cpu_threads_per_rank(ranks_on_node: int) -> int:
    """Threads for each CPU rank: ``OMP_NUM_THREADS`` when set (torchrun sets it to 1 when it starts
    several ranks per node; the test suite sets it to 1 because its workers run side by side),
    else an equal share of this machine's cores."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value:
        try:
            threads = int(value)
        except ValueError as e:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {value!r}") from e
        if threads < 1:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {value!r}")
        return threads
    return max(1, (os.cpu_count() or 1) // max(1, ranks_on_node))


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it, so parallel runs differ)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_device_type() -> str:
    """"cuda" when a GPU is visible, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for_device(device: torch.device | str) -> str:
    """NCCL for GPUs, gloo for CPUs (gloo lacks fast GPU collectives, NCCL has no CPU ones)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def is_shared_gpu(device_type: str, ranks_on_node: int) -> bool:
    """Whether ``ranks_on_node`` ranks on CUDA must share GPUs (more ranks than visible GPUs)."""
    return device_type == "cuda" and ranks_on_node > torch.cuda.device_count()


def check_devices(device_type: str | None, backend: str | None, ranks_on_node: int) -> tuple[str, str]:
    """The (device type, backend) a job of ``ranks_on_node`` local ranks will use, or a
    ValueError naming what cannot work, before any process starts or any collective hangs.

    ``None`` picks the defaults: CUDA if available, and NCCL on CUDA, gloo on CPU. NCCL needs
    one GPU per rank on a node (two ranks on one GPU fail at their first collective with
    "Duplicate GPU detected"); gloo may share GPUs.
    """
    device_type = device_type or default_device_type()
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device_type!r}")
    backend = backend or backend_for_device(device_type)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but no CUDA GPU is visible (torch.cuda.is_available() is False)")
    if backend == "nccl" and device_type != "cuda":
        raise ValueError("the nccl backend needs CUDA devices; use --backend gloo on CPU")
    gpus = torch.cuda.device_count() if device_type == "cuda" else 0
    if backend == "nccl" and ranks_on_node > gpus:
        raise ValueError(
            f"nccl needs one GPU per rank: {ranks_on_node} ranks on this node but {gpus} "
            f"GPU{'s' if gpus != 1 else ''} visible; run at most {gpus} ranks per node, or "
            "--backend gloo to let ranks share a GPU"
        )
    return device_type, backend


def select_device(local_rank: int, device_type: str) -> torch.device:
    """The device for a local rank: ``cuda:<local_rank mod #GPUs>`` (made current), or the CPU.

    Several ranks may share one GPU (modulo), which only gloo supports; NCCL needs one GPU per rank.
    """
    if device_type == "cpu":
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
