"""A pool of ranks that stays up between runs: one spawn and one process group, many cases.

Spawning ranks costs seconds (each imports torch and joins a group); the cases the tests run on
them cost milliseconds. :class:`RankPool` spawns ``world_size`` ranks once, joins them in one
process group, and then runs ``fn(ctx, *args)`` on every rank as often as it is asked, as
:func:`~cs336_systems.launch.spawn.launch` would, returning each rank's result (rank 0's first).

A case that fails ends that case alone, with its message, and the pool starts afresh for the next:
* a rank raises: :class:`RankFailedError` with the first failing rank's traceback (its peers,
  likely stuck in a collective that rank never joined, are given a moment to report too);
* a rank dies (a signal, ``os._exit``): :class:`RankFailedError` naming the rank and how it died,
  before its peers' errors, which follow from it;
* the case outlives its deadline: :class:`TimeoutError` naming the ranks that had not finished.
In each case every rank is stopped: a group that lost a rank, or whose ranks disagree on which
collective comes next, cannot be trusted with another case; the next :meth:`RankPool.run`
spawns new ranks. A case run on a pool sees the state earlier cases left in its rank processes
(modules imported, seeds, caches): cases that need a fresh process belong to ``launch``.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Any, Callable, Sequence

import torch.distributed as dist

from cs336_systems.launch.context import DEFAULT_TIMEOUT_S, check_devices, find_free_port
from cs336_systems.launch.env import init_from_env, teardown
from cs336_systems.launch.lifetime import exit_rank
from cs336_systems.launch.signals import Interrupted, become_rank_process, raising_on_signals
from cs336_systems.launch.spawn import RankFailedError, _is_port_clash, _stop

# How long a failed case's other ranks get to send their own report before all are stopped.
PEER_REPORT_GRACE_S = 2.0
START_TIMEOUT_S = 300.0  # spawning and joining the group, on a loaded machine


def _pool_rank_main(index: int, world_size: int, port: int, backend: str | None, device_type: str | None,
                    timeout_s: float, conn: mp.connection.Connection, parent_pid: int) -> None:
    """One pool rank: join the group, then run each case the pool sends until told to stop.

    Every message is pickled with the standard pickler (tensors travel by value, as launch's
    result files carry them); a reply is ("ok", result) or ("error", "<time>\\n<traceback>")."""
    become_rank_process(parent_pid)
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    def reply(kind: str, payload: Any) -> None:
        conn.send_bytes(pickle.dumps((kind, payload)))

    def failure() -> str:
        return f"{time.time():.6f}\n" + traceback.format_exc()

    try:
        ctx = init_from_env(backend=backend, device_type=device_type, timeout_s=timeout_s)
    except BaseException:
        reply("error", failure())
        exit_rank(1)
    reply("ready", None)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the pool is gone
            exit_rank(1)
        if not message:  # the pool closes: leave the group together
            teardown()
            exit_rank(0)
        try:
            fn, args = pickle.loads(message)
            result = fn(ctx, *args)
            # As launch's teardown does after its one run: no rank starts the next case while a
            # peer is still in this one's collectives.
            dist.barrier()
            reply("ok", result)
        except BaseException:
            reply("error", failure())
            # The pool stops this rank; wait here rather than take another case.
            signal.pause()


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode}"


class RankPool:
    """``world_size`` ranks spawned once, running case after case in one process group."""

    def __init__(self, world_size: int, *, backend: str | None = None, device_type: str | None = "cpu",
                 timeout_s: float = DEFAULT_TIMEOUT_S, port_attempts: int = 3) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        check_devices(device_type, backend, world_size)
        self.world_size, self.backend, self.device_type = world_size, backend, device_type
        self.timeout_s, self.port_attempts = timeout_s, port_attempts
        self.processes: list = []
        self.conns: list[mp.connection.Connection] = []
        self.spawns = 0  # how many times ranks were spawned: 1 while no case has failed

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), *, deadline_s: float | None = None) -> list[Any]:
        """``fn(ctx, *args)`` on every rank; the list of results, rank 0's first.

        ``fn`` and ``args`` must pickle (``fn`` importable at module level) and so must the results.
        ``deadline_s`` (default: 3 x the group's timeout) bounds the case; a failure stops the
        ranks and raises (see the module docstring), and the next call spawns new ones."""
        if not self.processes:
            self._start()
        message = pickle.dumps((fn, tuple(args)))
        for conn in self.conns:
            conn.send_bytes(message)
        deadline = time.monotonic() + (deadline_s if deadline_s is not None else 3 * self.timeout_s)
        replies = self._collect("ok", deadline, getattr(fn, "__qualname__", repr(fn)))
        return [replies[rank] for rank in range(self.world_size)]

    def close(self) -> None:
        """Let the ranks leave the group together and exit; stop any that do not within 30 s."""
        for conn in self.conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + 30
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self._stop()

    def _stop(self) -> None:
        _stop(self.processes, grace_s=0.0)
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []

    def _start(self) -> None:
        context = mp.get_context("spawn")
        for attempt in range(self.port_attempts):
            port = find_free_port()
            for index in range(self.world_size):
                mine, theirs = context.Pipe(duplex=True)
                process = context.Process(
                    target=_pool_rank_main, name=f"pool-rank{index}",
                    args=(index, self.world_size, port, self.backend, self.device_type, self.timeout_s, theirs,
                          os.getpid()))
                process.start()
                theirs.close()
                self.processes.append(process)
                self.conns.append(mine)
            self.spawns += 1
            try:
                self._collect("ready", time.monotonic() + START_TIMEOUT_S, "joining the process group")
                return
            except RankFailedError as e:
                if _is_port_clash(str(e)) and attempt + 1 < self.port_attempts:
                    continue
                raise

    def _collect(self, expected: str, deadline: float, what: str) -> dict[int, Any]:
        """Every rank's reply of kind ``expected``; on any failure stop all ranks and raise."""
        replies: dict[int, Any] = {}
        # (0 for a rank that died, 1 for one that raised; when, by the ranks' clock; rank; report)
        failures: list[tuple[int, float, int, str]] = []
        pending = set(range(self.world_size))
        first_failure_at: float | None = None
        try:
            with raising_on_signals():
                while pending:
                    if failures and first_failure_at is None:  # the peers' reports, if they come soon
                        first_failure_at = time.monotonic()
                        deadline = min(deadline, first_failure_at + PEER_REPORT_GRACE_S)
                    waiting = {self.conns[r]: r for r in pending} | {self.processes[r].sentinel: r for r in pending}
                    ready = mp.connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
                    if not ready:
                        break
                    for handle in ready:
                        rank = waiting[handle]
                        if rank not in pending:
                            continue
                        conn = self.conns[rank]
                        try:
                            if handle is not conn and not conn.poll():
                                raise EOFError
                            kind, payload = pickle.loads(conn.recv_bytes())
                        except (EOFError, OSError):  # it died: its exit status says how
                            self.processes[rank].join(1)
                            failures.append((0, time.time(), rank, f"rank{rank} {_describe_exit(self.processes[rank].exitcode)} "
                                                                   f"while {what}"))
                            pending.discard(rank)
                            continue
                        pending.discard(rank)
                        if kind == expected:
                            replies[rank] = payload
                        else:
                            stamp, _, text = payload.partition("\n")
                            failures.append((1, float(stamp), rank, f"rank{rank} raised while {what}:\n{text}"))
        except Interrupted as e:
            stopped = len([p for p in self.processes if p.is_alive()])
            self._stop()
            raise Interrupted(e.signum, f"stopped {stopped} of {self.world_size} pool ranks") from None
        if not failures and not pending:
            return replies
        self._stop()
        if failures:
            # A rank that died comes first: its peers' errors ("connection closed by peer") follow
            # from it, yet are stamped before this process sees it gone. Then by the ranks' stamps.
            failures.sort()
            others = ", ".join(f"rank{rank}" for _, _, rank, _ in failures[1:]) or "none"
            stuck = f"; still running: {', '.join(f'rank{r}' for r in sorted(pending))}" if pending else ""
            raise RankFailedError(f"{failures[0][3]}\n(then failed: {others}{stuck}; the pool's ranks were stopped)")
        raise TimeoutError(f"{', '.join(f'rank{r}' for r in sorted(pending))} of {self.world_size} ranks had not finished "
                           f"{what} by its deadline; the pool's ranks were stopped")
