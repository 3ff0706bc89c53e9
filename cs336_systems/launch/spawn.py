"""Running a function on several ranks: spawned here, or as this process's rank under a launcher.

:func:`launch` spawns ``world_size`` ranks on this machine, rendezvousing on a free port bound
to 127.0.0.1, and returns each rank's return value; :func:`run_ranks` does that, or, under
torchrun or SLURM, runs the function as the one rank this process is. A failing rank brings
the run down with its own traceback (the earliest failure is reported), a run that outlives
its deadline is killed, and a signal to the launcher stops every rank (see signals.py).
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp

from cs336_systems.launch.context import DEFAULT_TIMEOUT_S, check_devices, find_free_port
from cs336_systems.launch.env import init_from_env, run_then_teardown, running_under_launcher
from cs336_systems.launch.lifetime import exit_rank
from cs336_systems.launch.signals import Interrupted, become_rank_process, raising_on_signals

# How long terminated ranks get to exit before they are killed.
TERMINATE_GRACE_S = 5.0


class RankFailedError(RuntimeError):
    """A spawned rank raised; the message holds the first failing rank's traceback."""


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
    parent_pid: int,
) -> None:
    """Entry point of one spawned rank (module level so that spawn can pickle it)."""
    become_rank_process(parent_pid)
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

    report_path = Path(result_dir) / f"rank{local_index}.err"

    def record_failure() -> None:
        # Record when and why this rank failed, before its peers see it go: they fail soon
        # after with "connection reset", and the launcher reports the earliest failure.
        if not report_path.exists():
            report_path.write_text(f"{time.time():.6f}\n" + traceback.format_exc())

    # The launcher reads this rank's outcome from its files (a result, or a failure report), so
    # the rank ends with os._exit once they are closed: interpreter finalization could still
    # abort a finished rank on whatever a user's function left to the collective threads
    # (lifetime.py), and would turn a success into SIGABRT.
    try:
        ctx = init_from_env(backend=backend, device_type=device_type, timeout_s=timeout_s)
        result = run_then_teardown(fn, ctx, args, on_error=record_failure)
        with open(Path(result_dir) / f"rank{ctx.rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        record_failure()
        exit_rank(1)
    exit_rank(0)


def _is_port_clash(report: str) -> bool:
    text = report.lower()
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
    so even a rank stuck outside any collective cannot hang the caller. SIGTERM or SIGINT to
    this process terminates every rank and raises :class:`Interrupted`.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    check_devices(device_type, backend, world_size)
    deadline_s = join_timeout_s if join_timeout_s is not None else 3 * timeout_s
    for attempt in range(port_attempts):
        port = find_free_port()
        with tempfile.TemporaryDirectory(prefix="ranks-") as result_dir:
            rank_args = (world_size, port, fn, tuple(args), backend, device_type, timeout_s, result_dir, os.getpid())
            try:
                _spawn_and_join(rank_args, world_size, deadline_s)
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
                # A rank reports its failure in its .err file and exits with status 1; one
                # killed by a signal leaves none, and the exception names the signal.
                report = _first_failure(Path(result_dir), e)
                # Another process may take the port between find_free_port() and the bind.
                if _is_port_clash(report) and attempt + 1 < port_attempts:
                    continue
                raise RankFailedError(report) from e
            results = []
            for rank in range(world_size):
                with open(Path(result_dir) / f"rank{rank}.pkl", "rb") as f:
                    results.append(pickle.load(f))
            return results
    raise AssertionError("unreachable")


def _first_failure(result_dir: Path, error: Exception) -> str:
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


def _stop(processes: list, grace_s: float = TERMINATE_GRACE_S) -> int:
    """Terminate the live processes, kill those still alive after ``grace_s``; how many were live."""
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        process.terminate()
    deadline = time.monotonic() + grace_s
    for process in alive:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in alive:
        if process.is_alive():
            process.kill()
            process.join()
    return len(alive)


def _spawn_and_join(rank_args: tuple, world_size: int, deadline_s: float) -> None:
    with raising_on_signals():
        context = mp.start_processes(
            _rank_main, args=rank_args, nprocs=world_size, join=False, start_method="spawn"
        )
        start = time.monotonic()
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() - start > deadline_s:
                    _stop(context.processes, grace_s=0.0)
                    raise TimeoutError(
                        f"{world_size} ranks did not finish within {deadline_s:.0f} s; killed them"
                    )
        except Interrupted as e:
            stopped = _stop(context.processes)
            raise Interrupted(e.signum, f"stopped {stopped} of {world_size} ranks") from None


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
        return [run_then_teardown(fn, ctx, args)]
    return launch(fn, world_size, args, **launch_kwargs)


def run_setting(fn: Callable[..., Any], setting: Any, timeout_s: float = 600, join_timeout_s: float = 3600) -> Any:
    """A benchmark's run from its setting (a LaunchSetting): checked before any process starts
    (ValueError), ``fn(ctx, setting)`` run on every rank with the setting's world size, backend and
    device (:func:`run_ranks`), and rank 0's result; the benchmarks make every rank return the
    same one. ``timeout_s`` bounds one collective, ``join_timeout_s`` the whole run."""
    setting.validate()
    return run_ranks(fn, setting.world_size, args=(setting,), backend=setting.backend, device_type=setting.device,
                     timeout_s=timeout_s, join_timeout_s=join_timeout_s)[0]
