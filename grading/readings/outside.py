"""What the grader reads about a rank from outside it: its memory, at pauses.

A number a rank counts itself (objects the collector lists, bytes a wrapper saw) can be frozen,
hidden or faked by the submission's code beside it. The kernel's own count of a process's
resident memory cannot: ``/proc/<pid>/status`` (``RssAnon``: the heap and anonymous mappings
where tensors live; ``RssShmem``: shared memory, a ``/dev/shm`` mapping too), read by the grader
while the rank is stopped. The protocol, one pause:

* the rank (``pause``, rank side) collects its garbage, hands freed heap back to the kernel
  (``malloc_trim``), writes a pause frame ``{"pause": label}`` on its report pipe, then stops
  itself with SIGSTOP, which no handler can catch;
* the grader (``take_pauses``, called by ranks.run_ranks for each frame it reads) waits until the
  kernel shows the rank stopped (state ``T``), reads the resident memory of the rank and of every
  process descended from it (a helper it forked holds memory too), checks the rank is still
  stopped, and sends SIGCONT.

Where the grader could give the rank a memory cgroup of its own (rank_cgroups.py), the reading
that counts (``bytes``) is that cgroup's total charge instead, which also holds what no process's
resident set shows (a file in a tmpfs or on disk, a pipe's buffer, a page a pipe keeps after its
file was truncated, a helper that left the rank's tree); its parts (``parts``, a second witness,
and each of anonymous, file, kernel and socket memory) and the resident memory stay beside it
(``resident``; its shared part, ``shmem``, a witness of its own: memory.shared), and ``source``
says which was read. Where no cgroup can be made, ``bytes`` is
what every process of the rank's tree holds (``resident_bytes``): the sum over the rank and each
process descended from it of its resident anonymous and shared memory (``RssAnon + RssShmem``:
a page it shares with another process counted in each), plus, where the ranks' storage is on
disk, the files the ranks' uid holds there (``stored_on_disk``).

A rank that does not stop within ``STOP_WAIT_S`` (its ``os.kill`` patched, say) is recorded
without a reading, and a check that needs one fails. The readings reach the checks as the
rank's report's ``"outside"`` entry, set by the grader over anything the rank put there.

Large tensors come from ``mmap`` and go back to the kernel when freed, whatever their size:
``mallopt(M_MMAP_THRESHOLD)`` fixes glibc's threshold at 64 KiB (otherwise it rises to the size of
the largest block freed, and a freed gathered weight would stay resident in the heap).
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
import time

from grading.isolation import sandbox, wire
from grading.isolation.rank_cgroups import memory_kb

KEY = "outside"  # a report's entry the grader fills with its readings
BEFORE = "before the submission"  # a measured rank's first pause: its memory before any of its code ran
IMPORTED = "after the submission's import"  # its second: the submission's modules imported, nothing built yet
STOP_WAIT_S = 5.0  # a rank loaded by a busy machine takes a moment to reach its SIGSTOP
MAX_PAUSES = 12  # a measured run makes at most 5; more are a rank's own frames, let go unread
MMAP_THRESHOLD = 64 << 10
M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = -3, -1


def _libc():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def freeze_in_fork_server() -> None:
    """In the fork server, once it imported torch and the suite (grading.suite.training, its last
    preload, calls this): the objects alive go to the collector's permanent generation there,
    before any rank is forked. Done in each rank instead, it rewrote every object's header and
    so copied every page of torch's objects the ranks share with the server (about 80 MB per
    rank: the correct fixture's peak rose from 834 to 1081 MB)."""
    if sys.argv[:1] == ["-c"] and "multiprocessing.forkserver" in sys.modules:
        gc.freeze()


def prepare_rank() -> None:
    """Rank side, in every rank of every test, before the submission runs: freed tensors leave the
    resident set (see the module); the objects alive now (torch's, the suite's: frozen in the fork
    server already, so this moves only the few made since) go to the collector's permanent
    generation, so that the collection before a pause scans only what was made since (a full
    collection over torch's objects takes 0.4 s on a busy machine). The same in every test:
    nothing here tells a measured test from another."""
    gc.freeze()
    return_freed_memory()


def return_freed_memory() -> None:
    """Large blocks from ``mmap``, returned to the kernel when freed (see the module): in a rank,
    so that a freed tensor leaves the reading; in the grader (the suite's conftest), so that the
    measured runs' references do not stay resident as heap (150 MB more at the correct
    fixture's peak without it)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, MMAP_THRESHOLD)


# A collective's buffer can outlive its call for a moment: gloo's worker thread drops its
# reference after wait() has returned (a correct FSDP rank was once read 6 MB, one gathered
# weight, above its usual at one pause of six, under load). A short sleep lets it go; the checks
# judge the least reading over the steps besides.
SETTLE_S = 0.05


def pause(report_fd: int, label: str) -> None:
    """Rank side: stop here until the grader has read this rank's memory from outside."""
    time.sleep(SETTLE_S)
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    data = wire.encode({"pause": label})
    view = memoryview(len(data).to_bytes(8, "little") + data)
    while view:
        view = view[os.write(report_fd, view):]
    os.kill(os.getpid(), signal.SIGSTOP)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"




def descendants(pid: int) -> list[int]:
    """``pid`` and every process whose chain of parents reaches it (from each /proc/N/stat)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [pid], [pid]
    while frontier:
        below = [child for child, ppid in parent.items() if ppid in frontier and child not in found]
        found += below
        frontier = below
    return found


def resident_bytes(pid: int) -> dict[str, int] | None:
    """What the kernel counts resident for ``pid`` and its descendants: anonymous and shared
    memory (a tensor's bytes, wherever the process keeps them), in bytes; and how many processes.
    None where the grader cannot read the rank's own counts (a /proc mounted with hidepid)."""
    if "RssAnon" not in memory_kb(pid):
        return None
    anon = shmem = 0
    processes = descendants(pid)
    for p in processes:
        kb = memory_kb(p)
        anon += kb.get("RssAnon", 0) << 10
        shmem += kb.get("RssShmem", 0) << 10
    return {"bytes": anon + shmem, "anon": anon, "shmem": shmem, "processes": len(processes)}


def stored_on_disk() -> int | None:
    """Where ranks keep their files on disk (``DISK_ENV``: no user namespace for a tmpfs of their
    own), what the ranks' uid holds in files: a file synced and dropped from the page cache holds
    what no memory reading sees (student.disk_bytes; the ranks of a test share the uid, so each
    rank's reading counts them all). None elsewhere, or past the scan's budget."""
    uid = os.environ.get("GRADING_STUDENT_UID")
    if not os.environ.get(sandbox.DISK_ENV) or not uid:
        return None
    from grading.isolation import student

    return student.disk_bytes(int(uid), [p for p in os.environ.get(sandbox.DISK_ENV, "").split(os.pathsep) if p])


def read_stopped(pid: int, label: str, cgroup_read=None) -> dict:
    """Grader side: wait for the stopped rank, read it, let it go on. With ``cgroup_read`` (the
    rank's memory cgroup, rank_cgroups.py), ``bytes`` is that cgroup's charge, and the resident
    memory of the rank's tree is kept beside it (``resident``)."""
    deadline = time.monotonic() + STOP_WAIT_S
    while _state(pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.002)
    reading: dict = {"label": label, "at": round(time.monotonic(), 3)}
    if _state(pid) == "T":
        memory = resident_bytes(pid)
        if memory is None:
            reading["grader_error"] = f"the grader cannot read /proc/{pid}/status (RssAnon)"
        elif cgroup_read is not None:
            charged = cgroup_read()
            if charged is None:
                reading["grader_error"] = "the grader cannot read the rank's memory cgroup"
            elif _state(pid) == "T":  # no one woke it while it was read
                reading.update(charged, resident=memory["bytes"], shmem=memory["shmem"])
        elif _state(pid) == "T":  # no one woke it while it was read
            reading.update(memory, source="resident")
        if "bytes" in reading and (on_disk := stored_on_disk()) is not None:
            reading.update(bytes=reading["bytes"] + on_disk, disk=on_disk,
                           **({"parts": reading["parts"] + on_disk} if "parts" in reading else {}))
        elif "bytes" in reading and os.environ.get(sandbox.DISK_ENV):
            reading = {"label": label, "at": reading["at"],
                       "grader_error": "the files the ranks' uid holds are too many to read at a pause"}
    try:
        os.kill(pid, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass
    return reading


def take_pauses(buffer: bytearray, pid: int, readings: list[dict], frame, cgroup_read=None) -> None:
    """Grader side: consume every whole pause frame at the head of ``buffer`` (``frame`` returns a
    whole message or None), reading the rank's memory for each (its cgroup's, with
    ``cgroup_read``); the report, if any, stays."""
    while (message := frame(buffer)) is not None and message:
        try:
            decoded = wire.decode(message)
        except wire.WireError:
            return
        if not (isinstance(decoded, dict) and set(decoded) == {"pause"} and isinstance(decoded["pause"], str)):
            return
        del buffer[:8 + len(message)]
        if len(readings) >= MAX_PAUSES:  # a rank that sends pauses by the thousand must not hold the grader
            try:
                os.kill(pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass
            if readings[-1].get("label") != "too many pauses":
                readings.append({"label": "too many pauses"})
            continue
        readings.append(read_stopped(pid, decoded["pause"][:80], cgroup_read))
