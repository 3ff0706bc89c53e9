"""First process of a grading run (harness.py), and the view of the file systems a rank gets.

* The first process is made not dumpable: a process of the same user can then neither trace it
  nor open its descriptors under ``/proc`` without CAP_SYS_PTRACE, which ranks give up
  (``confine``, here, which the fork server and every rank call); where the grader is root, ranks run as another uid besides (student.py).
* The environment that runs the grader may have this repository installed (``uv sync`` puts its
  root on ``sys.path`` through a .pth file); a submission that lacks a module must not find ours
  instead, so that entry is dropped here, before pytest, the fork server and every rank.
* Everything the grader's tests import is imported before the first test (``preload``).
* In new namespaces (``GRADING_NETNS``): ``lo`` exists but is down, and gloo's ranks talk over it;
  root of the namespaces may set its flags (SIOCSIFFLAGS), as ``ip link set lo up`` would.
* ``rank_view``, called by the fork server (rank_server.py) before it gives up its capabilities:
  a mount namespace of its own, shared by the ranks it forks, in which the grader's private
  folders (the fork server's socket), OUT, the submissions' folder and every other submission's
  scratch copy are covered by empty file systems; ``/dev`` is a fresh tmpfs holding only null,
  zero, full, random and urandom (no tty, no disk), and a ``/dev/shm`` in the ranks' home; ``/proc/sys`` and
  the other kernel knobs under ``/proc``, ``/sys`` and every cgroup file system are read-only, as
  is every other file system but the ranks' home (the submission's scratch copy is read-only to them).
"""

import ctypes
import errno
import fcntl
import os
import runpy
import socket
import struct
import sys

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
PR_SET_DUMPABLE = 4
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 21
MOUNT_OPTIONS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                 "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
CLONE_NEWNS, MS_PRIVATE, O_PATH = 0x00020000, 1 << 18, 0o10000000
DEVICES = ("null", "zero", "full", "random", "urandom")
KERNEL_KNOBS = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs", "/proc/acpi")


def not_dumpable() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def drop_bounding_set() -> None:
    """Drop every capability from the bounding set (needs CAP_SETPCAP; without it, there is nothing to drop)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in range(64):
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP


def confine() -> None:
    """Give up every capability this process has, and the means to regain one.

    The grader's own processes are not dumpable: a process of the same user may then trace
    them, or open their descriptors under ``/proc``, only with CAP_SYS_PTRACE. As root (CI,
    Gradescope) or as root of a user namespace a rank would have it; after this it has none,
    not even through exec (no new privileges, root not special, no ambient set)."""
    if not sys.platform.startswith("linux"):
        return
    not_dumpable()  # its peers cannot open its report pipe through /proc either
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_no_new_privs, pr_set_securebits, pr_cap_ambient = 38, 28, 47
    libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0)
    libc.prctl(pr_cap_ambient, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    drop_bounding_set()
    # SECBIT_NOROOT, its lock, KEEP_CAPS_LOCKED, NO_CAP_AMBIENT_RAISE and its lock
    libc.prctl(pr_set_securebits, 0x01 | 0x02 | 0x20 | 0x40 | 0x80, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    libc.capset(header, (ctypes.c_uint32 * 6)())  # effective, permitted, inheritable: none
    if capabilities() != 0:
        raise RuntimeError("the grader could not drop this rank's capabilities; it runs no submission code")


CLONE_NEWUSER, CLONE_NEWIPC = 0x10000000, 0x08000000
PRIVATE_STORAGE_ENV = "GRADING_PRIVATE_STORAGE"
DISK_ENV = "GRADING_RANK_STORAGE_ON_DISK"  # set by the harness where ranks have no tmpfs of their own: where they write
STORAGE_BYTES = 256 << 20  # each of a rank's tmpfs mounts (home, /dev/shm): far above what a test writes


def private_storage(home: str, shm: str | None = None, tree: str | None = None) -> str | None:
    """A rank's own storage, made by the rank before it runs any of the submission's code: a user
    namespace of its own (no privilege is needed for one where the kernel allows it), and in it
    a mount namespace where ``home`` (its HOME and TMPDIR) and ``/dev/shm`` (or ``shm``, the folder
    bound there) are fresh tmpfs mounts, and an IPC namespace. Its peers cannot read what it
    writes there, and what it writes is charged to its own memory cgroup and dies with it: no
    file, segment or queue is shared between ranks (the process group's store is a TCP store that
    rank 0 serves: ranks.py), and nothing a rank can write is on a disk. Each tmpfs has a size
    (``STORAGE_BYTES``): a rank that fills it gets ENOSPC, and its memory cgroup's limit bounds
    them together. The submission's copy (``tree``, read-only
    to the ranks) is seen again, writable, at ``home/work/<its name>`` (an overlay whose changes
    stay in the rank's tmpfs; a read-only bind where overlays are refused), the rank's working
    folder: code that writes beside itself, or in ``../data``, as students' code does when run
    from its checkout, writes into the rank's own storage. That folder, or None where the kernel
    or a container refuses a user namespace (the rank then shares the run's home, which the
    grader empties after every test, scrub.py)."""
    if not user_namespaces_allowed():
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC) != 0:
        return None
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # its own /proc/self files, to write its maps
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    finally:
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", home, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={STORAGE_BYTES}")
    for folder in {"/dev/shm", *([shm] if shm else [])}:
        if os.path.isdir(folder) and not _inside(folder, home):
            _mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={STORAGE_BYTES}")
    if tree is None:
        return home
    view = os.path.join(home, "work", os.path.basename(os.path.realpath(tree)) or "submission")
    upper, work = os.path.join(home, ".overlay", "upper"), os.path.join(home, ".overlay", "work")
    for folder in (view, upper, work):
        os.makedirs(folder, exist_ok=True)
    try:
        _mount("overlay", view, "overlay", MS_NOSUID | MS_NODEV, f"lowerdir={tree},upperdir={upper},workdir={work}")
    except OSError:
        _mount(tree, view, None, MS_BIND | MS_REC)
    return view


def user_namespaces_allowed() -> bool:
    """Linux, and not refused by ``GRADING_PRIVATE_STORAGE=0`` (how the tests grade as a
    container that refuses user namespaces would, without changing the machine's settings)."""
    return sys.platform.startswith("linux") and os.environ.get(PRIVATE_STORAGE_ENV) != "0"


def user_namespaces() -> bool:
    """Whether a rank could make its own storage here (``private_storage``): a child process, as
    ``uid`` would be, makes a user namespace and leaves."""
    if not user_namespaces_allowed():
        return False
    pid = os.fork()
    if pid == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        os._exit(0 if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC) == 0 else 1)
    return os.waitpid(pid, 0)[1] == 0


def capabilities() -> int:
    """This process's effective capability set, as /proc shows it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def preload() -> None:
    """What the grader's tests use, imported before the first test. pytest-timeout interrupts a
    test that overruns; if that test was importing (torch imports ``torch._dynamo`` lazily, on the
    first optimizer step), the module stayed half-imported and every later test of the run failed
    on it ("triton.language has no attribute core"), a student failure that was the grader's.
    What the imports put in the environment (torch._dynamo sets ``TORCHINDUCTOR_CACHE_DIR`` to a
    folder of this process's TMPDIR) is taken out again: the fork server inherits this process's
    environment, and that folder is covered in the ranks' view."""
    before = dict(os.environ)
    import torch
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn.functional  # noqa: F401
    import torch.optim  # noqa: F401

    weight = torch.nn.Parameter(torch.zeros(1))
    weight.grad = torch.ones(1)
    for optimizer in (torch.optim.AdamW([weight]), torch.optim.SGD([weight], lr=0.1, momentum=0.9)):
        optimizer.step()  # what a first step imports, imported here
    for key in set(os.environ) - set(before):
        del os.environ[key]


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def hide(folder: str) -> None:
    hidden = os.path.realpath(folder)
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != hidden]


def _mounts() -> list[tuple[str, set[str], str]]:
    """(mount point, per-mount options, file system type) of every mount, from mountinfo."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fields = left.split()
            point = fields[4].encode().decode("unicode_escape")  # \\040 for a space
            found.append((point, set(fields[5].split(",")), right.split()[0]))
    return found


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                  data and data.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def cover(hidden: list[str], keep: list[str]) -> None:
    """An empty tmpfs over each folder of ``hidden``; the folders of ``keep`` under one are bound
    back in at the same path (through descriptors opened before it was covered)."""
    for folder in sorted({os.path.realpath(h) for h in hidden if os.path.isdir(h)}, key=len):
        if not os.path.isdir(folder) or folder == "/":
            continue  # already under a covered folder
        inner = [k for k in {os.path.realpath(k) for k in keep} if _inside(k, folder) and os.path.isdir(k)]
        fds = {k: os.open(k, O_PATH | os.O_DIRECTORY) for k in inner}
        _mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
        for k, fd in sorted(fds.items()):
            os.makedirs(k, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", k, None, MS_BIND | MS_REC)
            os.close(fd)


def relink(links: list[tuple[str, str]]) -> None:
    """Each link that a covered folder held, made again where the interpreter's paths name it (a
    ``.venv`` linking to another environment); what it leads to was bound back by ``cover``."""
    for link, target in links:
        if not os.path.lexists(link) and os.path.exists(target):
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(target, link)


def private_dev(shm: str | None = None) -> None:
    """``/dev`` as a fresh tmpfs with only the harmless devices (bound from the real ones), the
    usual links to ``/proc/self/fd`` and a ``/dev/shm`` of the ranks' own: ``shm`` (a folder in
    their home, bound there, which the grader empties after every test: scrub.py), else a fresh
    tmpfs."""
    fds = {name: os.open(f"/dev/{name}", O_PATH) for name in DEVICES if os.path.exists(f"/dev/{name}")}
    _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name, fd in fds.items():
        open(f"/dev/{name}", "w").close()
        _mount(f"/proc/self/fd/{fd}", f"/dev/{name}", None, MS_BIND)
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/shm")
    if shm is not None:
        _mount(shm, "/dev/shm", None, MS_BIND)
    else:
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=1g")


def read_only_except(writable: list[str]) -> list[str]:
    """Remount every file system here read-only but ``writable`` (bound onto themselves first, so
    they stay writable) and ``/dev/shm``; ``/proc`` stays, but not its kernel knobs. The mount
    points that could not be made read-only."""
    for knob in KERNEL_KNOBS:
        if os.path.exists(knob):
            _mount(knob, knob, None, MS_BIND | MS_REC)
    kept = {os.path.realpath(p) for p in writable}
    for path in kept:
        _mount(path, path, None, MS_BIND | MS_REC)
    libc = ctypes.CDLL(None, use_errno=True)
    failed = []
    for point, options, fstype in _mounts():
        if (fstype == "proc" and not any(_inside(point, k) for k in KERNEL_KNOBS)) or point == "/dev/shm" \
                or "ro" in options or not os.path.lexists(point) or any(_inside(point, k) for k in kept):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in options:
            flags |= MOUNT_OPTIONS.get(option, 0)
        if libc.mount(None, point.encode(), None, flags, None) != 0 and ctypes.get_errno() != errno.ENOENT:
            failed.append(point)
    return failed


def rank_view(writable: list[str], hidden: list[str], keep: list[str],
              links: list[tuple[str, str]] = (), shm: str | None = None) -> list[str]:
    """The ranks' mount namespace (see the module's docstring), made in this process and inherited
    by every process it forks; the mount points that could not be made read-only."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the grader's view
    cover(hidden, [*keep, *writable])
    relink(links)
    private_dev(shm)
    return read_only_except(writable)


if __name__ == "__main__":
    not_dumpable()
    if os.environ.get("GRADING_HIDE"):
        hide(os.environ["GRADING_HIDE"])
    if os.environ.get("GRADING_NETNS"):
        loopback_up()
    preload()
    sys.argv = ["pytest", *sys.argv[1:]]
    runpy.run_module("pytest", run_name="__main__", alter_sys=True)
