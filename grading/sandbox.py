"""First process of a grading run (harness.py): the grader's own, before pytest starts.

* It is made not dumpable: a process of the same user can then neither trace it nor open its
  descriptors under ``/proc`` without CAP_SYS_PTRACE, which ranks give up (ranks.confine).
* The environment that runs the grader may have this repository installed (``uv sync`` puts its
  root on ``sys.path`` through a .pth file); a submission that lacks a module must not find ours
  instead, so that entry is dropped here, before pytest, the fork server and every rank.
* In new namespaces (``GRADING_NETNS``): ``lo`` exists but is down, and gloo's ranks talk over it;
  root in the user namespace may set its flags (SIOCSIFFLAGS), as ``ip link set lo up`` would. Every
  file system is then remounted read-only in this mount namespace, except the submission's scratch
  copy and its home (``GRADING_WRITABLE``), and ``/dev/shm`` is a fresh tmpfs: a rank can write
  neither the grader's files nor this repository's, nor another submission's.
"""

import ctypes
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
KEEP_WRITABLE_TYPES = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "devtmpfs"}


def not_dumpable() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


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


def read_only_except(writable: list[str]) -> list[str]:
    """Remount every file system read-only here but ``writable`` (bound onto themselves first,
    so they stay writable); the mount points that could not be made read-only."""
    libc = ctypes.CDLL(None, use_errno=True)
    before = _mounts()
    for path in writable:
        libc.mount(path.encode(), path.encode(), None, MS_BIND | MS_REC, None)
    libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1g")
    failed = []
    for point, options, fstype in before:
        if fstype in KEEP_WRITABLE_TYPES or point == "/dev/shm" or "ro" in options:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in options:
            flags |= MOUNT_OPTIONS.get(option, 0)
        if libc.mount(None, point.encode(), None, flags, None) != 0:
            failed.append(point)
    return failed


if __name__ == "__main__":
    not_dumpable()
    if os.environ.get("GRADING_HIDE"):
        hide(os.environ["GRADING_HIDE"])
    if os.environ.get("GRADING_NETNS"):
        loopback_up()
        left = read_only_except(list(filter(None, os.environ.get("GRADING_WRITABLE", "").split(os.pathsep))))
        if left:
            print(f"grading sandbox: could not make read-only: {', '.join(left)}", flush=True)
    sys.argv = ["pytest", *sys.argv[1:]]
    runpy.run_module("pytest", run_name="__main__", alter_sys=True)
