"""Running one test's ranks: the only processes that run a submission's code.

Each test starts ``world_size`` processes from a fork server that imported torch and the
suite's rank-side code (``grading.suite.training``) but never the submission (a fresh interpreter per
rank costs seconds; a fork, milliseconds). Where the grader may make cgroups, it moves each rank
into a memory cgroup of its own, which the rank waits for before it joins its group, and kills
whatever is left in it when the test ends (rank_cgroups.py). The fork server confines itself before it imports
anything (rank_server.py: as root, the student uid; no capability; with namespaces, the ranks'
own view of the file systems); its socket lies in the grader's private folder, never in the
ranks' TMPDIR. A rank confines itself again (``sandbox.confine``), puts the submission's folders on
``sys.path`` *after* the standard library and site-packages, joins a gloo group through a TCP
store that rank 0 serves on the run's loopback (no folder is shared between ranks: whatever a
rank keeps in the store is in rank 0's memory, and whatever crosses it crosses the loopback the
grader reads), runs a rank function on the data the grader sent, and writes its report
to a pipe of its own in ``grading.isolation.wire``'s format, then leaves without finalizing the
interpreter (gloo's teardown can abort a rank that finished its work; the report is sent by
then).

The grader process (pytest) never imports the submission, reads reports without unpickling
them, and decides: it waits until a deadline, and a rank that raised, died, left without a
report or hung fails the test with a one-line reason (``file:line: what``). A rank holds no
descriptor of the grader's but its own pipe: the fork server starts from a clean exec, and its
children close what it holds; multiprocessing's resource tracker is never started (see
``_context``).
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from grading.readings import outside, review, traffic
from grading.isolation import policy, preload, rank_cgroups, scrub, wire
from grading.isolation.sandbox import STORAGE_BYTES, confine, private_storage
from grading.selfcheck import GRADER_FAILURE

# Set by the harness; a test run by hand gets the defaults.
TEST_TIMEOUT_S = float(os.environ.get("GRADING_TEST_TIMEOUT", "60"))
GRACE_AFTER_ERROR_S = 5.0  # how long peers of a failed rank may take to fail or finish on their own
_FRAME = struct.Struct("<Q")


class RankFailure(Exception):
    """A test's ranks failed; ``reason`` is the one line the grade shows."""

    def __init__(self, reason: str, timed_out: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.timed_out = timed_out

    @property
    def grader(self) -> bool:
        return self.reason.startswith(GRADER_FAILURE)


@dataclass(frozen=True)
class Rank:
    """What a rank function is given: its place in the group."""

    rank: int
    world_size: int
    report_fd: int = -1  # its report pipe: outside.pause writes a pause frame on it
    release_fd: int = -1  # the grader's pipe to it: what a hold's release carries (traffic.py)
    arm: Callable[[], None] = lambda: None  # the witnesses start (review.witness): the submission is imported

    def pause(self, label: str) -> None:
        """Stop until the grader has read this rank's memory from outside (grading/readings/outside.py)."""
        if label == outside.IMPORTED:
            self.arm()
        outside.pause(self.report_fd, label)

    def hold(self, label: str) -> bytes:
        """Stop until every rank holds at ``label`` and the grader has read the loopback's bytes
        from outside (grading/readings/traffic.py); what the grader sent at the release (b"" if nothing)."""
        self.arm()
        return traffic.hold(self.report_fd, self.release_fd, label)


def submission_roots() -> list[str]:
    """Folders of the graded tree, as the harness set them (this checkout when run by hand)."""
    roots = os.environ.get("GRADING_SUBMISSION_ROOTS")
    return roots.split(os.pathsep) if roots else [os.getcwd()]


def where_in_submission(tb: traceback.StackSummary | list[traceback.FrameSummary],
                        roots: list[str] | None = None) -> str | None:
    """``file:line`` of the innermost frame in the submission's own files, relative to its root."""
    real = [os.path.realpath(r) for r in (roots or submission_roots())]
    for frame in reversed(list(tb)):
        path = os.path.realpath(frame.filename)
        for root in real:
            if path.startswith(root + os.sep) and "site-packages" not in path:
                return f"{os.path.relpath(path, root)}:{frame.lineno}"
    return None


def one_line(exc: BaseException, roots: list[str] | None = None) -> str:
    """An exception as the single line a grade shows: where in the submission, then what."""
    if isinstance(exc, SyntaxError) and exc.filename:
        where = where_in_submission([traceback.FrameSummary(exc.filename, exc.lineno or 0, "")], roots)
        return f"{where or exc.filename}: SyntaxError: {exc.msg}"
    where = where_in_submission(traceback.extract_tb(exc.__traceback__), roots)
    if type(exc).__name__ == "AdapterMissing":
        return str(exc)
    if isinstance(exc, AssertionError):  # the suite's own in-rank checks say what they found
        return str(exc).splitlines()[0] if str(exc) else "assertion failed"
    what = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        what += f" (a rank's home and /dev/shm are tmpfs of {STORAGE_BYTES >> 20} MiB each: the grader's bound)"
    if isinstance(exc, NotImplementedError):
        what = "NotImplementedError (adapter not implemented)"
    elif isinstance(exc, SystemExit):
        what = f"the submission called sys.exit({exc.code!r})"
    return f"{where}: {what}" if where else what


def _use_submission(roots: list[str], workdir: str | None = None) -> None:
    """Import the submission's packages after everything else, and nothing in their place.

    The path keeps the standard library, site-packages, the grader's own folder and the folders
    the harness found this Python's packages in (``GRADING_PACKAGE_PATHS``), then the
    submission's folders: its ``torch.py`` or ``pytest.py`` shadows nothing. Any other entry
    goes: a project installed in editable mode puts its root on the path through a .pth file,
    and this repository's ``cs336_systems`` must never stand in for a submission's. The working
    directory is the submission's root, or the rank's own writable view of it (``workdir``:
    sandbox.private_storage), as when it runs its own tests."""
    import site
    import sysconfig

    grader = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(wire.__file__))))
    allowed = {os.path.realpath(p) for p in (*(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                                                   "platlib")),
                                             *site.getsitepackages(), grader,
                                             *filter(None, os.environ.get("GRADING_PACKAGE_PATHS", "").split(os.pathsep)))}
    zipped = os.path.realpath(sys.base_prefix)

    def kept(entry: str) -> bool:
        real = os.path.realpath(entry) if entry else ""
        return bool(entry) and (any(real == a or real.startswith(a + os.sep) for a in allowed)
                                or (real.endswith(".zip") and real.startswith(zipped + os.sep)))

    sys.path[:] = [p for p in sys.path if kept(p) and os.path.realpath(p) not in map(os.path.realpath, roots)]
    sys.path.extend(roots)
    if os.environ.get("GRADING_SUBMISSION_PACKAGES"):  # what it declares and the grader installed for it
        sys.path.append(os.environ["GRADING_SUBMISSION_PACKAGES"])
    os.chdir(workdir or roots[0])


def _no_device_to_wait_for(torch) -> None:
    """On a grading machine without a GPU, ``torch.cuda.synchronize()`` waits for nothing, as it
    does for CPU tensors on a machine with one: a submission timing its all-reduces with it
    (graded on gloo and CPU tensors, as the course's tests run) is not failed for a GPU the
    grader lacks."""
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None


def _send(fd: int, data: bytes) -> None:
    view = memoryview(_FRAME.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _rank_main(rank: int, world_size: int, store_port: int, fn: Callable, payload: bytes, writer: Any,
               roots: list[str], cgroup: tuple[str, str] | None = None, release: Any = None,
               output: Any = None) -> None:
    """Entry point of one forked rank: its standard output and error into ``output`` (a pipe the
    grader drains: see ``Output``), confine, wait to be in its memory cgroup (``cgroup``: its
    name and kind, rank_cgroups.py), join the group, run ``fn``, report, leave (``release``: the
    grader's pipe that lets it go on from a hold, traffic.py)."""
    started = False  # the submission's code can run only from here on (``fn`` imports it)
    try:
        if output is not None:
            os.dup2(output.fileno(), 1)
            os.dup2(output.fileno(), 2)
            output.close()
        workdir = None
        if (home := scrub.rank_home()) is not None:
            workdir = private_storage(home, os.environ.get("GRADING_RANK_SHM"),
                                      roots[0] if os.environ.get("GRADING_TREE_READ_ONLY") else None)
        confine()
        policy.install(policy.AT_START)  # before the submission's first import, on every thread
        if cgroup is not None:
            rank_cgroups.wait_until_moved(*cgroup)
        _use_submission(roots, workdir if workdir != home else None)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        outside.prepare_rank()
        _no_device_to_wait_for(torch)
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=rank == 0,
                              timeout=timedelta(seconds=TEST_TIMEOUT_S), wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=TEST_TIMEOUT_S + 30))  # the deadline comes first
        # Every rank connected before any runs the submission: gloo's init has no barrier, and a
        # rank whose test ended before its first collective (or before any) left its peer still
        # connecting, which failed there with "connection closed by peer", a start-up failure.
        dist.barrier()
        policy.install(policy.GROUP_UP)
        arm = review.witness(lambda message: _send(writer.fileno(), wire.encode(message)),
                             [*roots, *([workdir] if workdir else [])], on_disk=home is not None and workdir is None)
        started = True
        preload.import_declared()  # the submission's declared packages, in this rank alone (preload.py)
        ctx = Rank(rank, world_size, writer.fileno(), release.fileno() if release is not None else -1, arm)
        report: dict = {"value": fn(ctx, wire.decode(payload))}
    except BaseException as exc:  # noqa: BLE001 - anything a student's code raises is a result
        report = {"error": f"rank {rank}: {one_line(exc, roots)}", "start_up": not started}
    try:
        data = wire.encode(report)
    except Exception as exc:  # noqa: BLE001
        data = wire.encode({"error": f"rank {rank}: its report could not be sent: {exc}"})
    try:
        _send(writer.fileno(), data)
    finally:
        os._exit(0)


class Output:
    """What one rank wrote to its standard output and error, through a pipe the grader drains as
    the test runs: nothing of it lands in a file (a file's pages would be charged to the rank's
    memory cgroup and read as what it stores) and the grader keeps only its first and last
    ``KEEP`` bytes and the count, for the TA (the test's captured output, on a failure). A rank
    that prints megabytes costs itself the time to write them, and nothing else."""

    KEEP = 1024

    def __init__(self, rank: int):
        self.rank, self.head, self.tail, self.count = rank, b"", b"", 0

    def take(self, chunk: bytes) -> None:
        self.count += len(chunk)
        if len(self.head) < self.KEEP:
            self.head += chunk[:self.KEEP - len(self.head)]
        self.tail = (self.tail + chunk)[-self.KEEP:]

    def drain(self, fd: int) -> bool:
        """Read what is there without waiting; False once the rank's end is closed."""
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not chunk:
                return False
            self.take(chunk)

    def summary(self) -> str:
        if not self.count:
            return ""
        text = self.head.decode(errors="replace")
        if self.count > self.KEEP:
            text += f"\n[... {self.count - 2 * self.KEEP if self.count > 2 * self.KEEP else 0} bytes left out ...]\n" \
                + self.tail[-min(self.KEEP, self.count - self.KEEP):].decode(errors="replace")
        return f"--- rank {self.rank} wrote {self.count} bytes (first and last {self.KEEP} kept) ---\n{text}"


_FORKSERVER: Any = None


def _context():
    """The fork server, started once per grader process with torch and the rank-side code loaded.

    It confines itself first (rank_server.py: its first preload). multiprocessing's resource
    tracker, a helper that unlinks what its pipe names and whose pipe every rank would inherit,
    is never started: its descriptor is ``/dev/null``, and a rank's semaphores die with its
    namespace or its uid's files (student.remove_files)."""
    global _FORKSERVER
    if _FORKSERVER is None:
        from multiprocessing import resource_tracker

        resource_tracker._resource_tracker._fd = os.open(os.devnull, os.O_WRONLY)
        _FORKSERVER = mp.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(["grading.isolation.rank_server", "torch", "torch._dynamo", "torch.distributed",
                                            "grading.suite.training", "grading.isolation.preload"])
    return _FORKSERVER


def _start(p) -> None:
    """Start a rank; from a fresh fork server if the old one refuses it. Under heavy load a fork
    server was seen alive with its socket closed (dying, not yet reaped): every test started
    until it was reaped failed with ConnectionRefusedError, a correct submission's included."""
    try:
        p.start()
    except (ConnectionRefusedError, FileNotFoundError, EOFError, BrokenPipeError):
        from multiprocessing import forkserver

        server = forkserver._forkserver  # the one the forkserver context starts ranks from
        if server._forkserver_pid is not None:
            try:
                os.kill(server._forkserver_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                server._stop()  # reaps it and forgets it: the next start launches a new one
            except OSError:  # its socket file is gone already
                server._forkserver_address = None
        p.start()


def _reasons(errors: list[str]) -> str:
    """The first failing rank's reason, then those of other ranks that say something else: a
    peer that died while the first waited for it (gloo's "connection closed by peer") names the
    cause only in its own line. At most 500 characters."""
    said, others = {errors[0].split(": ", 1)[-1]}, []
    for error in errors[1:]:
        what = error.split(": ", 1)[-1]
        if what not in said:
            said.add(what)
            others.append(error)
    return (errors[0] + (f" (also {'; '.join(others)})" if others else ""))[:500]


def _exit_line(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        return f"rank {rank} died ({signal.Signals(-code).name})" if -code in signal.valid_signals() \
            else f"rank {rank} died (signal {-code})"
    return f"rank {rank} exited (code {code}) before reporting its results"


def run_ranks(fn: Callable, world_size: int, payloads: list[bytes], timeout_s: float | None = None,
              releases: dict[str, list[bytes]] | None = None) -> list[Any]:
    """Run ``fn(Rank, decode(payloads[rank]))`` on ``world_size`` new ranks; their values, by rank.
    ``releases``: what the grader sends each rank when the group is let go from a hold of that
    label (traffic.Holds), so that the phase after it cannot start before the grader's reading.

    Raises RankFailure with the failing ranks' one-line reasons (``_reasons``) if any rank raised, died,
    left without a report, sent an unreadable one, or the group was still running after
    ``timeout_s``; every rank process is gone when it returns.
    """
    timeout_s = TEST_TIMEOUT_S if timeout_s is None else timeout_s
    ctx = _context()
    roots = submission_roots()
    groups = rank_cgroups.RankCgroups.make(world_size)  # None: memory is read from /proc alone
    port = free_port()
    procs, buffers, fds, released, outputs = [], {}, {}, [], {}
    for r in range(world_size):
        reader, writer = ctx.Pipe(duplex=False)
        release_reader, release_writer = ctx.Pipe(duplex=False)
        output_reader, output_writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, daemon=True,
                        args=(r, world_size, port, fn, payloads[r], writer, roots,
                              (groups.name(r), groups.kind) if groups else None, release_reader, output_writer))
        _start(p)
        if groups:
            _enter(groups, r, p)
        writer.close()
        release_reader.close()
        output_writer.close()
        os.set_blocking(output_reader.fileno(), False)
        outputs[output_reader.fileno()] = (output_reader, Output(r))
        released.append(release_writer)
        os.set_blocking(reader.fileno(), False)
        procs.append((p, reader))
        fds[reader.fileno()] = r
        buffers[r] = bytearray()
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    readings: dict[int, list[dict]] = {r: [] for r in range(world_size)}  # outside.py's, per rank
    witnessed: dict[int, list[str]] = {r: [] for r in range(world_size)}  # review.py's, per rank
    holds = traffic.Holds([p.pid for p, _ in procs], [w.fileno() for w in released], releases)  # the group's
    errors: list[str] = []
    start_up = 0  # errors raised before the submission's code could run
    try:
        open_fds, printing = set(fds), set(outputs)
        while open_fds and time.monotonic() < deadline:
            ready, _, _ = select.select(list(open_fds | printing), [], [],
                                        min(0.5, max(0.0, deadline - time.monotonic())))
            for fd in ready:
                if fd in outputs:
                    if not outputs[fd][1].drain(fd):
                        printing.discard(fd)
                    continue
                r = fds[fd]
                chunk = os.read(fd, 1 << 20)
                buffers[r] += chunk
                _take_frames(buffers[r], r, procs[r][0].pid, readings[r], holds,
                             (lambda r=r: groups.read(r)) if groups else None, witnessed[r])
                done = _frame(buffers[r])
                if done is None and chunk and len(buffers[r]) <= wire.MAX_MESSAGE_BYTES + _FRAME.size:
                    continue
                open_fds.discard(fd)
                if done is None:
                    p = procs[r][0]
                    p.join(timeout=2)
                    line = _exit_line(r, p.exitcode) if not chunk else \
                        f"rank {r} sent a report over {wire.MAX_MESSAGE_BYTES >> 20} MiB"
                    if groups and groups.hit_limit(r):
                        line += (f" (its memory cgroup reached the grader's bound of "
                                 f"{rank_cgroups.RANK_MEMORY_BYTES >> 30} GiB per rank)")
                    errors.append(line)
                else:
                    try:
                        report = wire.decode(done)
                    except wire.WireError as e:
                        report = {"error": f"rank {r} sent an unreadable report ({e})"}
                    if isinstance(report, dict) and "value" in report:
                        values[r] = report["value"]
                    else:
                        error = report.get("error") if isinstance(report, dict) else None
                        errors.append(error if isinstance(error, str) else f"rank {r} sent an unreadable report")
                        start_up += isinstance(report, dict) and report.get("start_up") is True
                if errors:
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_ERROR_S)
            holds.expire()
    finally:
        for p, reader in procs:
            _kill(p)
            reader.close()
        if groups:
            groups.close()  # every process the ranks left, a double-forked helper too
        for release_writer in released:
            release_writer.close()
        for fd, (output_reader, output) in outputs.items():
            output.drain(fd)
            output_reader.close()
            if output.count:
                print(output.summary())  # the test's captured output: grade.md's log on a failure
    scrub.after_test()  # what the ranks left: no storage outlives its test
    if errors and start_up == len(errors):
        raise RankFailure(f"{GRADER_FAILURE}ranks could not start before the submission's code ran: {_reasons(errors)}")
    if errors:
        raise RankFailure(_reasons(errors))
    if len(values) < world_size:
        missing = sorted(set(range(world_size)) - set(values))
        raise RankFailure(f"timed out after {timeout_s:.0f} s (ranks {missing} never finished: "
                          "a collective that some rank never joined?)", timed_out=True)
    for r, value in values.items():
        if isinstance(value, dict):
            value[outside.KEY] = readings[r]  # the grader's, over anything the rank put there
            value[review.KEY] = witnessed[r]
            value[traffic.KEY] = holds.readings
    return [values[r] for r in range(world_size)]


def free_port() -> int:
    """A port free on this network namespace's loopback now, for rank 0's store: with namespaces
    the loopback is the run's own (no other grading binds there); the kernel hands out ephemeral
    ports in turn, so one just released is not handed to another process at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _enter(groups: rank_cgroups.RankCgroups, rank: int, p) -> None:
    """Move a started rank into its memory cgroup. If that fails the rank, waiting for it, ends
    with a start-up error (a grader failure, not the submission's); one that is gone already
    fails on its own."""
    try:
        groups.enter(rank, p.pid)
    except OSError:
        pass


def _take_frames(buffer: bytearray, rank: int, pid: int, readings: list[dict], holds: traffic.Holds,
                 read: Callable | None = None, witnessed: list[str] | None = None) -> None:
    """Every whole pause (outside.py; ``read``: the rank's memory cgroup reading, if any), witness
    (review.py) and hold (traffic.py) frame at the head of ``buffer``, in the order the rank sent
    them; the report, if any, stays."""
    while True:
        outside.take_pauses(buffer, pid, readings, _frame, read)
        if not (review.take(buffer, _frame, witnessed if witnessed is not None else [])
                or holds.take(buffer, rank, _frame)):
            return


def _frame(buffer: bytearray) -> bytes | None:
    """The whole message once its length prefix and every byte it announced have arrived."""
    if len(buffer) < _FRAME.size:
        return None
    (length,) = _FRAME.unpack_from(buffer)
    if length > wire.MAX_MESSAGE_BYTES:
        return b""  # decoded as unreadable
    return bytes(buffer[_FRAME.size:_FRAME.size + length]) if len(buffer) >= _FRAME.size + length else None


def _kill(p) -> None:
    """SIGKILL the rank even if the fork server (its parent, which reports its exit) was killed."""
    try:
        if p.pid and p.exitcode is None:  # a pid the fork server reported gone may be another's by now
            os.kill(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.join(timeout=5)
