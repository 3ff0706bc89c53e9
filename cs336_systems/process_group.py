"""Process-group life: start ranks, initialise, pick devices and backends, tear down.

Vocabulary used across the repo: a *rank* is one process of the job, numbered 0..world_size-1;
the *world size* is the number of ranks; the *local rank* numbers the ranks of one node and
picks that rank's GPU.

Two ways to get a process group:

* under ``torchrun`` (or SLURM via ``scripts/submit_slurm.py``), the launcher sets RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, and :func:`init_from_env` reads them;
* from a plain Python process, :func:`launch` spawns ``world_size`` ranks on this machine,
  rendezvousing on a free port bound to 127.0.0.1, and returns each rank's return value.

Every process group gets a timeout, so a rank that dies or skips a collective ends the run
with an error instead of leaving the others waiting forever.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Long enough for a slow first collective on a loaded 2-core machine, short enough that a
# broken test fails well inside the suite's budget.
DEFAULT_TIMEOUT_S = 120.0

_RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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


def select_device(local_rank: int, device_type: str | None = None) -> torch.device:
    """The device for a local rank: ``cuda:<local_rank mod #GPUs>`` when CUDA is wanted, else CPU.

    ``device_type=None`` means CUDA if available. Several ranks may share one GPU (modulo),
    which only gloo supports; NCCL needs one GPU per rank.
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type != "cuda":
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("device_type='cuda' was asked for, but torch.cuda.is_available() is False")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def backend_for_device(device: torch.device | str) -> str:
    """NCCL for GPUs, gloo for CPUs (gloo lacks fast GPU collectives, NCCL has no CPU ones)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def default_device_type() -> str:
    """"cuda" when a GPU is visible, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


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


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from e


def running_under_launcher() -> bool:
    """True when torchrun (or SLURM through our submitter) has set the rendezvous variables."""
    return all(name in os.environ for name in _RENDEZVOUS_VARS)


def init_from_env(
    backend: str | None = None,
    device_type: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> RankContext:
    """Initialise the default process group from torchrun-style environment variables.

    Reads RANK, WORLD_SIZE, LOCAL_RANK (defaults to RANK), MASTER_ADDR and MASTER_PORT.
    ``backend=None`` picks NCCL on GPU and gloo on CPU.
    """
    missing = [name for name in _RENDEZVOUS_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"cannot initialise the process group: environment variables {missing} are not set; "
            "run under torchrun, or use cs336_systems.process_group.launch() to spawn ranks"
        )
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE={world_size}), got {rank}")
    ranks_on_node = _env_int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ else world_size
    device_type, backend = check_devices(device_type, backend, ranks_on_node)
    device = select_device(local_rank, device_type)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    return RankContext(rank, world_size, local_rank, device, backend, ranks_on_node)


def teardown(clean: bool = True) -> None:
    """Leave the process group: wait for every rank (``clean``), then destroy it.

    The barrier keeps rank 0 (which hosts the rendezvous store) alive until the others are done
    with it; the group's timeout bounds the wait if a peer is gone. After an error, pass
    ``clean=False``: waiting for peers would only delay (and hide) the error being raised.
    """
    if not dist.is_initialized():
        return
    try:
        if clean:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_then_teardown(
    fn: Callable[..., Any],
    ctx: RankContext,
    args: Sequence[Any],
    on_error: Callable[[], None] | None = None,
) -> Any:
    try:
        result = fn(ctx, *args)
    except BaseException:
        if on_error is not None:
            on_error()
        teardown(clean=False)
        raise
    teardown()
    return result


def _rank_main(
    local_index: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    backend: str | None,
    device_type: str | None,
    timeout_s: float,
    result_dir: str,
) -> None:
    """Entry point of one spawned rank (module level so that spawn can pickle it)."""
    os.environ.update(
        RANK=str(local_index),
        LOCAL_RANK=str(local_index),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # All ranks are on this machine: keep gloo's traffic on loopback rather than whatever
    # interface the hostname resolves to (which may not exist in a sandbox).
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    def record_failure() -> None:
        # Record when and why this rank failed, before its peers see it go: they fail soon
        # after with "connection reset", and the launcher reports the earliest failure.
        report = f"{time.time():.6f}\n" + traceback.format_exc()
        (Path(result_dir) / f"rank{local_index}.err").write_text(report)

    try:
        ctx = init_from_env(backend=backend, device_type=device_type, timeout_s=timeout_s)
    except BaseException:
        record_failure()
        raise
    result = _run_then_teardown(fn, ctx, args, on_error=record_failure)
    with open(Path(result_dir) / f"rank{ctx.rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def _is_port_clash(error: BaseException) -> bool:
    text = str(error).lower()
    return "address already in use" in text or "eaddrinuse" in text


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    backend: str | None = None,
    device_type: str | None = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    join_timeout_s: float | None = None,
    port_attempts: int = 3,
) -> list[Any]:
    """Spawn ``world_size`` ranks on this machine, run ``fn(ctx, *args)`` on each, return results.

    ``fn`` must be importable at module level (spawn pickles it) and its return value picklable;
    the list holds rank 0's value first. If any rank raises, the others are terminated and the
    error is raised here. ``join_timeout_s`` (default: 3 x ``timeout_s``) bounds the whole run,
    so even a rank stuck outside any collective cannot hang the caller.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_devices(device_type, backend, world_size)
    deadline_s = join_timeout_s if join_timeout_s is not None else 3 * timeout_s
    for attempt in range(port_attempts):
        port = find_free_port()
        with tempfile.TemporaryDirectory(prefix="ranks-") as result_dir:
            try:
                _spawn_and_join(
                    (world_size, port, fn, tuple(args), backend, device_type, timeout_s, result_dir),
                    world_size,
                    deadline_s,
                )
            except mp.ProcessRaisedException as e:
                # Another process may take the port between find_free_port() and the bind.
                if _is_port_clash(e) and attempt + 1 < port_attempts:
                    continue
                raise RankFailedError(_first_failure(Path(result_dir), e)) from e
            results = []
            for rank in range(world_size):
                with open(Path(result_dir) / f"rank{rank}.pkl", "rb") as f:
                    results.append(pickle.load(f))
            return results
    raise AssertionError("unreachable")


class RankFailedError(RuntimeError):
    """A spawned rank raised; the message holds the first failing rank's traceback."""


def _first_failure(result_dir: Path, error: mp.ProcessRaisedException) -> str:
    reports = []
    for path in result_dir.glob("rank*.err"):
        stamp, _, text = path.read_text().partition("\n")
        reports.append((float(stamp), path.stem, text))
    if not reports:
        return str(error)
    reports.sort()
    _, rank_name, text = reports[0]
    others = ", ".join(name for _, name, _ in reports[1:]) or "none"
    return f"{rank_name} failed first (then: {others}):\n{text}"


def _spawn_and_join(rank_args: tuple, world_size: int, deadline_s: float) -> None:
    context = mp.start_processes(
        _rank_main, args=rank_args, nprocs=world_size, join=False, start_method="spawn"
    )
    start = time.monotonic()
    while not context.join(timeout=0.5):
        if time.monotonic() - start > deadline_s:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join()
            raise TimeoutError(
                f"{world_size} ranks did not finish within {deadline_s:.0f} s; killed them"
            )


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    **launch_kwargs: Any,
) -> list[Any]:
    """Run ``fn`` on every rank however the job was started.

    Under torchrun (rendezvous variables set) this process is one rank: it initialises from the
    environment, runs ``fn`` and returns ``[its result]``. Otherwise it spawns ``world_size``
    local ranks with :func:`launch` and returns all their results.
    """
    if running_under_launcher():
        ctx = init_from_env(
            backend=launch_kwargs.get("backend"),
            device_type=launch_kwargs.get("device_type"),
            timeout_s=launch_kwargs.get("timeout_s", DEFAULT_TIMEOUT_S),
        )
        return [_run_then_teardown(fn, ctx, args)]
    return launch(fn, world_size, args, **launch_kwargs)
