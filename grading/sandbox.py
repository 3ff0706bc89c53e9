"""First process of a grading run (harness.py): hide this repository, bring up loopback, run pytest.

The environment that runs the grader may have this repository installed (``uv sync`` puts its
root on ``sys.path`` through a .pth file); a submission that lacks a module must not find ours
instead, so that entry is dropped here, before pytest, the fork server and every rank (they
inherit this ``sys.path``). In a new network namespace ``lo`` exists but is down, and gloo's
ranks talk over it; root in the user namespace may set its flags (SIOCSIFFLAGS), as
``ip link set lo up`` would.
"""

import fcntl
import os
import runpy
import socket
import struct
import sys

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def hide(folder: str) -> None:
    hidden = os.path.realpath(folder)
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != hidden]


if __name__ == "__main__":
    if os.environ.get("GRADING_HIDE"):
        hide(os.environ["GRADING_HIDE"])
    if os.environ.get("GRADING_NETNS"):
        loopback_up()
    sys.argv = ["pytest", *sys.argv[1:]]
    runpy.run_module("pytest", run_name="__main__", alter_sys=True)
