"""What the ranks carried over the network, read by the grader from the kernel: bytes, at holds.

In namespace mode (containment.py, ``GRADING_NETNS``) the grader's pytest, the fork server and
every rank share a network namespace of their own, and gloo talks over its loopback: the kernel's
count of the bytes ``lo`` sent (``/proc/net/dev``, read by the grader in that namespace) is every
byte any rank sent any other, and nothing else (the file store is a file, the report pipes are
pipes). A submission can add bytes to it but never take any away, nor see the grader read it.
Without its own namespace the loopback is the machine's, shared with every other process: no
reading is this run's (``private`` says which), and the checks that need one are not made.

A phase of a step is told apart from the next by a *hold*, the pause protocol of outside.py held
for the whole group:

* a rank (``hold``, rank side, in the suite's own code) writes a hold frame ``{"hold": label}``
  on its report pipe and stops itself with SIGSTOP: all of its threads stop, gloo's included, so
  nothing it has not sent yet can be sent while it is held;
* the grader (``Holds``, driven by ranks.run_ranks) keeps each held rank stopped until every rank
  of the group is held at the same label, waits until the kernel shows them all stopped, reads
  the loopback's bytes, checks that none was woken meanwhile, writes each rank what that hold's
  release carries on a pipe of its own (the grader's; empty for most holds), and lets them all
  go on. The rank reads it before it goes on: one woken early by anyone else still waits there.

The labels are the suite's, and a rank's code could send its own frames or skip the suite's: a
reading is kept only if every rank held there, once, in the order the suite holds. A hold whose
release carries the next step's batch (checks.py, carried.batches_at_holds) cannot be moved: the
step cannot start before the grader read the bytes there, and its values are compared with the
grader's reference. The checks compare the bytes with what the grader measured itself (its own
calibration of gloo's collectives, carried.collective_loop).
"""

from __future__ import annotations

import os
import signal
import time

from grading.readings import outside
from grading.isolation import wire

KEY = "traffic"  # a report's entry the grader fills with its readings
HOLD_WAIT_S = 30.0  # how long held ranks wait for a peer that has not reached the same hold
MAX_HOLDS = 24  # a run of the suite holds at most 3 per step and 8 in the calibration


def private() -> bool:
    """Whether the loopback this process sees carries this run's ranks alone: the grader runs in
    the run's own network namespace (set by the harness; a submission cannot set the grader's
    environment). Else the machine's ``lo``, which every other process shares."""
    return os.environ.get("GRADING_NETNS") == "1"


def loopback_counts() -> tuple[int, int] | None:
    """The bytes and packets ``lo`` has sent in this process's network namespace (its transmit
    counts: on the loopback each byte sent is the byte received), or None where /proc/net/dev
    has no ``lo``."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, counts = line.partition(":")
                if name.strip() == "lo":
                    fields = counts.split()
                    return int(fields[8]), int(fields[9])
    except (OSError, IndexError, ValueError):
        return None
    return None


def loopback_bytes() -> int | None:
    """The bytes of ``loopback_counts``."""
    counts = loopback_counts()
    return counts[0] if counts else None


def hold(report_fd: int, release_fd: int, label: str) -> bytes:
    """Rank side: stop here until every rank holds here and the grader has read the loopback;
    what the grader sent with the release (read from its pipe: a rank woken early by anyone else
    still waits here for the grader)."""
    data = wire.encode({"hold": label})
    view = memoryview(len(data).to_bytes(8, "little") + data)
    while view:
        view = view[os.write(report_fd, view):]
    os.kill(os.getpid(), signal.SIGSTOP)
    if release_fd < 0:
        return b""
    length = int.from_bytes(_read_exactly(release_fd, 8), "little")
    return _read_exactly(release_fd, length)


def _read_exactly(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise RuntimeError("the grader closed the hold's release pipe")
        out += chunk
    return bytes(out)


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass


MAX_RELEASE = 16 << 10  # a release's data per rank: far under a pipe's buffer, so writing it never blocks


class Holds:
    """Grader side: the group's holds, released together once every rank is held at one label.

    ``readings`` gets one entry per hold: ``{"label", "bytes"}``, or ``{"label", "error"}`` where
    the hold could not be read as the group's (a rank woken while held, ranks held at different
    labels, a peer that never came). Every hold frame a rank sent gets one release frame on its
    pipe (``release_fds``): ``releases[label][rank]`` for a hold read as the group's, else empty."""

    def __init__(self, pids: list[int], release_fds: list[int], releases: dict[str, list[bytes]] | None = None):
        self.pids, self.release_fds, self.releases = pids, release_fds, releases or {}
        if any(len(d) > MAX_RELEASE for data in self.releases.values() for d in data):
            raise ValueError(f"grader error: a hold's release carries over {MAX_RELEASE} bytes")
        for fd in release_fds:
            os.set_blocking(fd, False)
        self.held: dict[int, tuple[str, float]] = {}  # rank -> (label, since)
        self.pending = [0] * len(pids)  # hold frames read and not yet released, per rank
        self.readings: list[dict] = []

    def take(self, buffer: bytearray, rank: int, frame) -> bool:
        """Consume one hold frame at the head of ``buffer`` (``frame`` returns a whole message or
        None); True if it was one."""
        message = frame(buffer)
        if not message:
            return False
        try:
            decoded = wire.decode(message)
        except wire.WireError:
            return False
        if not (isinstance(decoded, dict) and set(decoded) == {"hold"} and isinstance(decoded["hold"], str)):
            return False
        del buffer[:8 + len(message)]
        label = decoded["hold"][:80]
        self.pending[rank] += 1
        if len(self.readings) >= MAX_HOLDS or rank in self.held:
            if len(self.readings) < MAX_HOLDS + 1:
                self.readings.append({"label": label, "error": f"rank {rank} held again before it was let go"
                                      if rank in self.held else "too many holds"})
            self._release()
            return True
        self.held[rank] = (label, time.monotonic())
        labels = {held_label for held_label, _ in self.held.values()}
        if any("error" in r for r in self.readings):  # the run's traffic is unattributable already: no more waits
            self._release()
        elif len(labels) > 1:
            self.readings.append({"label": label, "error": f"ranks held at different points: {sorted(labels)}"})
            self._release()
        elif len(self.held) == len(self.pids):
            reading = self._read(label)
            self.readings.append(reading)
            self._release(label if "bytes" in reading else None)
        return True

    def expire(self) -> None:
        """Let held ranks go when a peer has not reached their hold within HOLD_WAIT_S."""
        if self.held and time.monotonic() - min(since for _, since in self.held.values()) > HOLD_WAIT_S:
            label = next(iter(self.held.values()))[0]
            missing = sorted(set(range(len(self.pids))) - set(self.held))
            self.readings.append({"label": label, "error": f"ranks {missing} did not reach it within "
                                                           f"{HOLD_WAIT_S:.0f} s of the others"})
            self._release()

    def _read(self, label: str) -> dict:
        deadline = time.monotonic() + outside.STOP_WAIT_S
        while not all(outside._state(p) == "T" for p in self.pids) and time.monotonic() < deadline:
            time.sleep(0.002)
        if not all(outside._state(p) == "T" for p in self.pids):
            return {"label": label, "error": "a rank did not stop at its hold"}
        counts = loopback_counts()
        if not all(outside._state(p) == "T" for p in self.pids):
            return {"label": label, "error": "a rank was woken while the grader held it"}
        if counts is None:
            return {"label": label, "error": "the grader cannot read lo's bytes in /proc/net/dev"}
        return {"label": label, "bytes": counts[0], "packets": counts[1], "at": round(time.monotonic(), 3)}

    def _release(self, label: str | None = None) -> None:
        """Every rank with a hold frame not yet answered gets its release frame(s), then SIGCONT;
        the data of ``label`` only where the group's hold there was read."""
        data = self.releases.get(label) if label is not None else None
        for rank, count in enumerate(self.pending):
            for _ in range(count):
                payload = data[rank] if data is not None else b""
                try:
                    os.write(self.release_fds[rank], len(payload).to_bytes(8, "little") + payload)
                except OSError:  # a rank gone, or one that never read its releases: it waits no more
                    pass
            self.pending[rank] = 0
            if count:
                _continue(self.pids[rank])
        self.held.clear()
