"""Issue 57: what a rank may do is a policy the kernel enforces (grading/isolation/policy.py).

* In a rank, each call ``policy.REFUSED`` names fails with EPERM (clone3 with ENOSYS), on a
  thread started before the filter and on a ``concurrent.futures`` worker too, and the calls
  honest code makes (threads, processes, private and file-backed maps, TCP sockets, a
  socketpair, a process group of its own) go through.
* A call made on a thread the submission started is the submission's: ctypes, mmap, a process,
  a compiled string and a socket, each made through a thread pool, are witnessed at the line that
  started the pool's thread.
* The manual's tables "What a rank may call" and "What each mode guarantees" are the policy's.
* Issue 57's routes 1 and 2, rebuilt as hostile fixtures, each graded in namespace mode and as
  Gradescope's container runs it (``GRADING_PRIVATE_STORAGE=0``, no namespaces): state parked in
  a memfd spliced into pipes (the weak optimizer: 5 of 15 honestly), and DDP's real average over
  an abstract Unix socket made and accepted on a thread pool behind all-reduces of zeros (a flat
  all-reduce after backward: 5/3 of 5 honestly). Each scores no more than its weak code.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grading.harness import grade
from grading.isolation import policy, ranks, wire
from tests.answers_fixture import PER_PARAMETER_FILE, apply_edits
from tests.test_grading import PER_PARAMETER, QUICK, ZERO, make_submission, points, unpassed
from tests.test_grading_sealed import WEAK_CAP, as_a_container, weak_with

pytestmark = pytest.mark.problem("beyond")

REPO = Path(__file__).resolve().parent.parent
OVERLAP_CAP = 5 / 3  # ddp_overlap_individual_parameters' cap: a flat all-reduce after backward earns at most this


def _calls() -> dict[str, dict]:
    """Each call this test makes in a rank once its group is up: (what it is, how to make it)."""
    import ctypes
    import mmap
    import socket
    import threading

    libc = ctypes.CDLL(None, use_errno=True)

    def c(result: int) -> int:
        if result < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        return result

    r, w = os.pipe()
    with open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"policy-{os.getpid()}"), "wb+") as f:
        f.write(b"x" * 4096)
        f.flush()
        made = {
            "memfd_create": lambda: os.memfd_create("state"),
            "splice": lambda: os.splice(f.fileno(), w, 16, offset_src=0),
            "sendfile": lambda: os.sendfile(w, f.fileno(), 0, 16),
            "shmget": lambda: c(libc.shmget(0, 4096, 0o1600)),
            "semget": lambda: c(libc.semget(0, 1, 0o1600)),
            "mmap shared anonymous": lambda: mmap.mmap(-1, 4096),
            "process_vm_readv": lambda: c(libc.process_vm_readv(os.getppid(), None, 0, None, 0, 0)),
            "ptrace": lambda: c(libc.ptrace(16, os.getppid(), 0, 0)),  # PTRACE_ATTACH
            "io_uring_setup": lambda: c(libc.syscall(425, 8, ctypes.create_string_buffer(120))),
            "userfaultfd": lambda: c(libc.syscall(323, 0)),
            "keyctl": lambda: c(libc.syscall(250, 0, -3, 0, 0, 0)),  # KEYCTL_GET_KEYRING_ID of the user keyring
            "unshare": lambda: c(libc.unshare(0x10000000)),
            "clone3": lambda: c(libc.syscall(435, None, 0)),
            "socket AF_UNIX": lambda: socket.socket(socket.AF_UNIX),
            "socket AF_UNIX on a pool": lambda: _pool().submit(socket.socket, socket.AF_UNIX).result(),
            "socket AF_NETLINK user": lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 2),  # NETLINK_USERSOCK
            "socket AF_ALG": lambda: socket.socket(38, socket.SOCK_SEQPACKET, 0),
            "socket AF_PACKET": lambda: socket.socket(17, socket.SOCK_RAW, 0),
            "memfd_create on a pool": lambda: _pool().submit(os.memfd_create, "state").result(),
            # what honest code does
            "mmap private anonymous": lambda: mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE),
            "mmap shared file": lambda: mmap.mmap(f.fileno(), 4096),
            "socket AF_INET": lambda: socket.socket(socket.AF_INET),
            "socket AF_INET6": lambda: socket.socket(socket.AF_INET6),
            "socket AF_NETLINK route": lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0),  # glibc's own
            "socketpair": socket.socketpair,
            "thread": lambda: threading.Thread(target=len, args=((),)).start(),
            "subprocess": lambda: subprocess.run(["true"], check=True),
            "fork": lambda: os.waitpid(pid, 0) if (pid := os.fork()) else os._exit(0),
        }
        outcome = {}
        for name, make in made.items():
            try:
                make()
                outcome[name] = "made"
            except OSError as exc:
                outcome[name] = errno.errorcode.get(exc.errno, str(exc.errno))
    return outcome


_POOL = []


def _pool():
    import concurrent.futures

    if not _POOL:
        _POOL.append(concurrent.futures.ThreadPoolExecutor(1))
    return _POOL[0]


def _rank_calls(ctx, _payload):
    import torch.distributed as dist

    outcome = _calls()
    group = dist.new_group()  # a group of its own once the filter is up: gloo connects again
    dist.all_reduce(__import__("torch").ones(1), group=group)
    return {"calls": outcome, "new_group": "made"}


REFUSED_IN_A_RANK = {"memfd_create", "splice", "sendfile", "shmget", "semget", "mmap shared anonymous",
                     "process_vm_readv", "ptrace", "io_uring_setup", "userfaultfd", "keyctl", "unshare",
                     "socket AF_UNIX", "socket AF_UNIX on a pool", "memfd_create on a pool",
                     "socket AF_NETLINK user", "socket AF_ALG", "socket AF_PACKET"}


def test_a_rank_is_refused_each_call_of_the_policy_and_none_that_honest_code_makes():
    """Two ranks (the grader's own rank start: storage, confinement, the filter, the group) make
    each call; every refused one fails with EPERM (clone3 with ENOSYS, so that glibc falls back to
    clone), whichever thread makes it, and the rest are made, a new process group included."""
    values = ranks.run_ranks(_rank_calls, 2, [wire.encode({})] * 2, timeout_s=60)
    for value in values:
        calls = value["calls"]
        assert {name for name, got in calls.items() if got == "EPERM"} == REFUSED_IN_A_RANK, calls
        assert calls["clone3"] == "ENOSYS", calls
        assert all(got == "made" for name, got in calls.items() if name not in REFUSED_IN_A_RANK | {"clone3"}), calls
        assert value["new_group"] == "made"


def test_every_refused_call_is_named_once_with_a_reason():
    """The policy's data is what the filter is built from: every call known to this kernel's
    libseccomp, each in one entry of each filter, and each entry says why."""
    import pyseccomp

    named = [call for entry in policy.REFUSED for call in entry.calls]
    once = [(call, entry.when) for entry in policy.REFUSED for call in entry.calls]  # socket: in both filters
    assert len(once) == len(set(once)), sorted(c for c in once if once.count(c) > 1)
    assert all(pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, call) >= 0 for call in named), named
    assert all(len(entry.reason) > 40 and entry.when in (policy.AT_START, policy.GROUP_UP) for entry in policy.REFUSED)
    assert all(bool(entry.where) == bool(entry.condition) for entry in policy.REFUSED)


POOL_CALLS = '''
import concurrent.futures, ctypes, mmap, socket, subprocess


def run():
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for call, args, kwargs in ((socket.socket, (socket.AF_INET,), {}), (mmap.mmap, (-1, 4096), {"flags": mmap.MAP_PRIVATE}),
                                   (ctypes.CDLL, (None,), {}), (subprocess.run, (["true"],), {}), (exec, ("x = 1",), {})):
            pool.submit(call, *args, **kwargs).result()
'''

WITNESS_THROUGH_A_POOL = '''
import sys
from grading.readings import review
sent = []
review.witness(sent.append, [sys.argv[1]])()
sys.path.append(sys.argv[1])
import pooled
pooled.run()
print("\\n".join(s["witness"] for s in sent))
'''


def test_the_five_watched_calls_made_through_a_thread_pool_are_the_submissions(tmp_path):
    """Every frame on a ``concurrent.futures`` worker is the standard library's; the thread was
    started by the submission's ``pool.submit`` (issue 57's second route made its socket so), so
    each call is witnessed there, once the witnesses are armed."""
    (tmp_path / "pooled.py").write_text(POOL_CALLS)
    done = subprocess.run([sys.executable, "-c", WITNESS_THROUGH_A_POOL, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    for what in ("opens a socket", "maps memory", "calls into C", "starts a process", "compiles code"):
        assert any(line.startswith("pooled.py:9: ") and what in line for line in lines), (what, lines)


RENAMED = '''
import socket

import torch.nn.modules.module as torchs


def _open():
    return socket.socket(socket.AF_INET)


_open.__code__ = _open.__code__.replace(co_filename=torchs.__file__)  # claims to be torch's code


def run():
    _open().close()
'''


def test_code_that_claims_a_librarys_file_name_is_still_the_submissions(tmp_path):
    """A code object names its own file (``co_filename``), which anyone can set: a fresh-eyes
    attack made its socket from a function renamed to torch's ``module.py``. The frame runs in
    the submission's module's globals, so the call is witnessed at the submission's line."""
    (tmp_path / "pooled.py").write_text(RENAMED)
    done = subprocess.run([sys.executable, "-c", WITNESS_THROUGH_A_POOL, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(line.startswith("pooled.py:") and "opens a socket" in line for line in done.stdout.splitlines()), done.stdout


def test_the_manual_holds_the_policys_tables():
    """grading/README.md's "What a rank may call" and "What each mode guarantees" are printed by
    ``python -m grading.isolation.policy``: change the policy, then paste its tables."""
    manual = (REPO / "grading" / "README.md").read_text()
    assert policy.calls_table() in manual, "grading/README.md: paste `python -m grading.isolation.policy`'s first table"
    assert policy.guarantees_table() in manual, "grading/README.md: paste its second table"


# Issue 57's first route: the whole state written to a memfd (else a file in TMPDIR), its pages
# moved into pipes by reference (splice, else sendfile), the file truncated, read back before the
# next step.
PARK_IN_PIPES = '''

def _park(opt):
    import fcntl, io, os
    params = list(opt.local.state)
    buffer = io.BytesIO()
    torch.save([opt.local.state[p] for p in params], buffer)
    data = buffer.getvalue()
    try:
        fd = os.memfd_create("state")
    except OSError:
        for folder in (os.environ.get("TMPDIR", "/tmp"), os.environ.get("HOME", "/tmp"), os.getcwd(), "/dev/shm"):
            path = os.path.join(folder, f"state-{os.getpid()}")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            except OSError:
                continue
            os.unlink(path)
            break
    os.write(fd, data)
    pipes, offset = [], 0
    while offset < len(data):
        r, w = os.pipe()
        fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
        size = min(1 << 20, len(data) - offset)
        try:
            moved = os.splice(fd, w, size, offset_src=offset)
        except OSError:
            moved = os.sendfile(w, fd, offset, size)
        pipes.append((r, w, moved))
        offset += moved
    os.ftruncate(fd, 0)
    os.close(fd)
    opt.local.state.clear()
    opt.parked = (params, pipes)


def _restore(opt):
    import io, os
    if getattr(opt, "parked", None):
        params, pipes = opt.parked
        data = b""
        for r, w, size in pipes:
            while size:
                chunk = os.read(r, size)
                data, size = data + chunk, size - len(chunk)
            os.close(r)
            os.close(w)
        for p, s in zip(params, torch.load(io.BytesIO(data), weights_only=True)):
            opt.local.state[p] = s
        opt.parked = None
'''

# Issue 57's second route: all-reduces of zeros during backward (what the probe and the loopback
# see), the real average over an abstract Unix socket that rank 0 makes and accepts on a
# thread pool, as every other rank makes and connects its own.
OVER_A_UNIX_SOCKET = [
    (PER_PARAMETER_FILE, "        dist.all_reduce(flat)  # the real average: one blocking all-reduce after backward\n",
     "        _sum_over_a_unix_socket(flat)\n"),
    (PER_PARAMETER_FILE, "\nclass DDPIndividualParameters", '''
import concurrent.futures
import os
import socket
import time

_POOL = concurrent.futures.ThreadPoolExecutor(1)
_SERVER = []


def _receive(connection, size):
    data = b""
    while len(data) < size:
        data += connection.recv(size - len(data))
    return data


def _sum_over_a_unix_socket(flat):
    name, rank, world = f"\\0average-{os.getppid()}", dist.get_rank(), dist.get_world_size()
    data = flat.numpy().tobytes()
    if rank == 0:
        if not _SERVER:
            server = _POOL.submit(socket.socket, socket.AF_UNIX).result()
            server.bind(name)
            server.listen(8)
            _SERVER.append(server)
        peers = [_POOL.submit(_SERVER[0].accept).result()[0] for _ in range(world - 1)]
        for peer in peers:
            flat.add_(torch.frombuffer(bytearray(_receive(peer, len(data))), dtype=flat.dtype))
        for peer in peers:
            peer.sendall(flat.numpy().tobytes())
            peer.close()
        return
    connection = _POOL.submit(socket.socket, socket.AF_UNIX).result()
    for _ in range(500):
        try:
            connection.connect(name)
            break
        except OSError:
            time.sleep(0.01)
    connection.sendall(data)
    flat.copy_(torch.frombuffer(bytearray(_receive(connection, len(data))), dtype=flat.dtype))
    connection.close()


class DDPIndividualParameters'''),
]


def route(tmp_path: Path, name: str) -> tuple[Path, str, str, float]:
    """A route's tree, its problem, the tests graded and the weak code's honest points."""
    if name == "pipes":
        return weak_with(tmp_path, name, PARK_IN_PIPES), ZERO, \
            "test_state_is_sharded or test_every_rank_keeps_its_share or test_matches_single_process", WEAK_CAP
    tree = apply_edits(make_submission(tmp_path / name, "zeros_during_backward"), name, OVER_A_UNIX_SOCKET)
    return tree, PER_PARAMETER, "test_communicates_during_backward or test_matches_single_process", OVERLAP_CAP


@pytest.mark.parametrize("mode", ["namespaces", "container"])
@pytest.mark.parametrize("name", ["pipes", "unix_socket"])
def test_issue_57s_routes_score_no_more_than_the_weak_code(tmp_path, name, mode):
    """Each route fails where the kernel refuses its call (memfd_create, then splice and sendfile;
    socket(AF_UNIX) on the pool's worker), in the student's own line, and earns no more than the
    weak code it dresses up, in namespace mode and as Gradescope's container runs it."""
    tree, problem, select, cap = route(tmp_path, name)
    if mode == "container":
        graded = as_a_container(tree, tmp_path / "out", problem, select)
        got, outputs = graded["points"][problem], graded["outputs"]
    else:
        result = grade(tree, tmp_path / "out", 1, "2026", QUICK, quiet=True, only=(problem,), select=select)
        got, outputs = points(result, problem), [t.output for t in result.tests if not t.passed]
        assert outputs, unpassed(result)
    assert got <= cap + 1e-9, (got, outputs)
    assert any("PermissionError: [Errno 1] Operation not permitted" in o and "cs336_systems/" in o for o in outputs), \
        outputs
