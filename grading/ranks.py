"""Running one test's ranks: fresh processes, a deadline, and one line that says what went wrong.

Student code runs only here, never in the pytest process: each test forks ``world_size`` new
processes that have torch imported already (a spawn costs seconds of imports, a fork
milliseconds), joins them to a gloo group through a file store (no
rendezvous port to collide with another grader), and runs a rank function of the suite. The
parent waits until a deadline; a rank that raises or a group that hangs is killed, whole, and
the test fails with a one-line reason (``file:line: what``) instead of a traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

# Set by the harness; a test run by hand gets the defaults.
TEST_TIMEOUT_S = float(os.environ.get("GRADING_TEST_TIMEOUT", "60"))
GRACE_AFTER_ERROR_S = 5.0  # how long peers of a failed rank may take to fail or finish on their own


class RankFailure(Exception):
    """A test's ranks failed; ``reason`` is the one line the grade shows."""

    def __init__(self, reason: str, timed_out: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.timed_out = timed_out


@dataclass(frozen=True)
class Rank:
    """What a rank function is given: its place in the group."""

    rank: int
    world_size: int


def submission_roots() -> list[str]:
    """Folders of the graded tree, as the harness set them (this checkout when run by hand)."""
    roots = os.environ.get("GRADING_SUBMISSION_ROOTS")
    return roots.split(os.pathsep) if roots else [os.getcwd()]


def where_in_submission(tb: traceback.StackSummary | list[traceback.FrameSummary]) -> str | None:
    """``file:line`` of the innermost frame in the submission's own files, relative to its root."""
    roots = [os.path.realpath(r) for r in submission_roots()]
    for frame in reversed(list(tb)):
        path = os.path.realpath(frame.filename)
        for root in roots:
            if path.startswith(root + os.sep) and "site-packages" not in path:
                return f"{os.path.relpath(path, root)}:{frame.lineno}"
    return None


def one_line(exc: BaseException) -> str:
    """An exception as the single line a grade shows: where in the submission, then what."""
    if isinstance(exc, SyntaxError) and exc.filename:
        where = where_in_submission([traceback.FrameSummary(exc.filename, exc.lineno or 0, "")])
        return f"{where or exc.filename}: SyntaxError: {exc.msg}"
    where = where_in_submission(traceback.extract_tb(exc.__traceback__))
    if type(exc).__name__ == "AdapterMissing":
        return str(exc)
    if isinstance(exc, AssertionError):  # the suite's own checks say what they found
        return str(exc).splitlines()[0] if str(exc) else "assertion failed"
    what = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    if isinstance(exc, NotImplementedError):
        what = "NotImplementedError (adapter not implemented)"
    return f"{where}: {what}" if where else what


def _rank_main(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple,
               results: Any) -> None:
    """Entry point of one forked rank: join the group, run ``fn``, report, leave."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=TEST_TIMEOUT_S + 30))  # the deadline comes first
        value = fn(Rank(rank, world_size), *args)
        results.put((rank, "ok", value))
    except BaseException as exc:  # noqa: BLE001 - anything a student's code raises is a result
        results.put((rank, "error", f"rank {rank}: {one_line(exc)}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may be gone already
                pass
    results.close()
    results.join_thread()


_FORKSERVER: Any = None


def _os_thread_count() -> int:
    """Threads of this process as the kernel counts them: Python's own count misses the ones
    torch starts in C++ (autograd's device workers, CUDA's)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _context():
    """Plain fork where this process runs one thread and has not initialised CUDA (a grading
    run: torch is imported already, nothing to redo); else a fork server that imported torch.
    ``make test``'s xdist workers run threads, forking a threaded process can copy a held
    lock, and a child forked after autograd started its device threads, or after CUDA was
    initialised, fails on its first backward or seed. Decided at every call: an earlier test
    in the same worker may have started them since."""
    global _FORKSERVER
    cuda_started = "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()
    if _os_thread_count() == 1 and not cuda_started and "fork" in mp.get_all_start_methods():
        return mp.get_context("fork")
    if _FORKSERVER is None:
        _FORKSERVER = mp.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "grading.cases"])
    return _FORKSERVER


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(Rank, *args)`` on ``world_size`` new ranks; every rank's return value, by rank.

    Raises RankFailure with the first rank's one-line reason if any rank raised, died, or the
    group was still running after ``timeout_s``; every rank process is gone when it returns.
    """
    timeout_s = TEST_TIMEOUT_S if timeout_s is None else timeout_s
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="grading-store-") as tmp:
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(r, world_size, os.path.join(tmp, "store"), fn, args, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        values: dict[int, Any] = {}
        errors: list[str] = []
        died: set[int] = set()
        try:
            while len(values) + len(errors) < world_size:
                now = time.monotonic()
                if now >= deadline:
                    break
                try:
                    rank, status, value = results.get(timeout=min(0.2, deadline - now))
                except queue.Empty:
                    for r, p in enumerate(procs):  # killed (a signal, out of memory) before it reported
                        if p.exitcode not in (None, 0) and r not in values and r not in died:
                            died.add(r)
                            errors.append(f"rank {r} died (exit code {p.exitcode})")
                            deadline = min(deadline, time.monotonic() + GRACE_AFTER_ERROR_S)
                    if errors and all(p.exitcode is not None for p in procs):
                        break
                    continue
                if status == "ok":
                    values[rank] = value
                else:
                    errors.append(value)
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_ERROR_S)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
            results.close()
    if errors:
        raise RankFailure(errors[0])
    if len(values) < world_size:
        missing = sorted(set(range(world_size)) - set(values))
        raise RankFailure(f"timed out after {timeout_s:.0f} s (ranks {missing} never finished: "
                          "a collective that some rank never joined?)", timed_out=True)
    return [values[r] for r in range(world_size)]
