"""First process inside the private namespaces (harness.py): bring up loopback, then run pytest.

A new network namespace has only ``lo``, and it is down; gloo's ranks talk over it. Root in the
user namespace may set its flags (SIOCSIFFLAGS), as ``ip link set lo up`` would.
"""

import fcntl
import os
import socket
import struct
import sys

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


if __name__ == "__main__":
    loopback_up()
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
