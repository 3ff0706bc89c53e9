"""A memory cgroup per rank: what the kernel charges to a rank and to everything it starts.

A rank's resident memory (outside.py) misses what its code moves out of every process between
two readings: a file in a tmpfs or in its home (page cache), a pipe's buffer, and a helper that
double-forked and so left the rank's tree of processes. The kernel's memory controller charges
each page to the cgroup of the process that allocated it, and a process stays in its parent's
cgroup whatever session or parent it takes. So, where the grader may make cgroups, each rank of
a test is moved by the grader into a cgroup of its own, under the run's memory cgroup (share.py
makes it; or, for a test run by hand on cgroup v1, one of this process's own), and a pause reads
what that cgroup holds (``RankCgroups.read``):

* the cgroup's total charge (``bytes``, what checks judge): every page the kernel charges to it,
  whoever maps it and wherever it lies (cgroup v2 ``memory.current``; v1
  ``memory.usage_in_bytes`` plus ``memory.kmem.tcp.usage_in_bytes``, which v1 keeps apart, and
  counts only once that counter has a limit: each rank's cgroup gets one). Pages a pipe holds
  after the file they came from was truncated, a tmpfs file, a socket's buffers, a helper that
  double-forked: all are in it, named by a part or not;
* its parts, which explain a reading and make none: the cgroup's anonymous charge, page cache and
  tmpfs pages (``file``), kernel memory (pipe buffers, page tables) and socket buffers (v2
  ``memory.stat``'s ``anon``, ``file``, ``kernel``, ``sock``; v1 ``total_rss``, ``total_cache``,
  ``memory.kmem.usage_in_bytes``, the TCP counter), and ``parts``, the reading issue 51 judged:
  the anonymous memory resident in every process in the cgroup (``RssAnon``) plus file, kernel
  and socket charges, a second witness (memory.py holds a problem where the two disagree across
  a bound);
* the peak (``memory.peak``, ``memory.max_usage_in_bytes``), recorded.

Pages a rank touched before its move stay charged where they were (the fork server's cgroup):
the rank waits for its move (``wait_until_moved``) before it joins its group, so its first
pause, before any of the submission's code runs, already reads its own cgroup, and what it
holds later is the growth from there, wherever its code put it.

After the test every process left in a rank's cgroup is killed (a helper it double-forked among
them) and the cgroup removed. A rank cannot leave its cgroup: moving a process needs write
access to ``cgroup.procs`` of the cgroup it goes to (and, on v2, of the common ancestor), files
that are root's (as root the ranks run as another uid) and, with namespaces, on a read-only file
system in the ranks' view (sandbox.py). As a plain user with a delegated cgroup v2 tree and no
namespaces, ranks share the grader's uid and could: that mode is not for untrusted work anyway.
"""

from __future__ import annotations

import atexit
import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
ENV = "GRADING_MEMORY_CGROUP"  # set by the harness: "v2:<folder>" or "v1:<folder>", the run's memory cgroup
V1_MEMORY = CGROUP / "memory"  # where a test run by hand looks for the v1 memory hierarchy
RANK_MEMORY_BYTES = 2 << 30  # a rank and all it starts: far above a test's needs (tens of MB beyond torch)
MOVE_WAIT_S = 30.0  # a rank waits this long for the grader to move it (a loaded machine)
_made: dict[str, Path | None] = {}  # this process's own parent, when it made one (a test run by hand, v1)


def _kind_and_parent() -> tuple[str, Path] | None:
    """Where this process makes its ranks' cgroups: the run's (the harness's variable), else, on a
    writable cgroup v1 memory hierarchy, a folder of this process's own; None where neither."""
    given = os.environ.get(ENV, "")
    if given[:3] in ("v1:", "v2:") and os.path.isdir(given[3:]):
        return ("cgroup " + given[:2], Path(given[3:]))
    if "own" not in _made:
        _made["own"] = _own_v1_parent()
    return ("cgroup v1", _made["own"]) if _made["own"] is not None else None


def _own_v1_parent() -> Path | None:
    """A folder for this process's ranks beside it in the v1 memory hierarchy (root), removed at exit."""
    if not (V1_MEMORY / "memory.usage_in_bytes").exists():
        return None
    own = own_path("memory")
    if own is None:
        return None
    base = V1_MEMORY / own.lstrip("/")
    remove_stale(base)
    folder = base / f"grading-ranks-{os.getpid()}"
    try:
        folder.mkdir(exist_ok=True)
    except OSError:
        return None
    atexit.register(remove_tree, folder)
    return folder


def own_path(controller: str | None) -> str | None:
    """This process's cgroup as /proc/self/cgroup names it: in the v1 hierarchy of ``controller``,
    or the unified (v2) one when ``controller`` is None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if (controller is None and number == "0") or (controller and controller in controllers.split(",")):
            return path
    return None


def remove_stale(parent: Path) -> None:
    """Rank cgroups a killed grader left (``grading-ranks-<its pid>``, that pid gone), emptied and removed."""
    for stale in parent.glob("grading-ranks-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            remove_tree(stale)


def _read(path: Path) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _stat(folder: Path) -> dict[str, int]:
    found = {}
    for line in (_read(folder / "memory.stat") or "").splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            found[name] = int(value)
    return found


MEMORY_LINES = ("RssAnon", "RssShmem", "RssFile")


def memory_kb(pid: int, proc: str = "/proc") -> dict[str, int]:
    """A process's resident memory lines (``MEMORY_LINES``, in kB; {} once it is gone), read from
    any of its threads: a process whose main thread has left (``pthread_exit``) while another
    serves on shows no memory lines in its own ``/proc/<pid>/status``, only in its threads'
    (every thread shares the one address space)."""
    def lines(path: str) -> dict[str, int]:
        found = {}
        for line in (_read(Path(path)) or "").splitlines():
            name, _, value = line.partition(":")
            if name in MEMORY_LINES and value.split() and value.split()[0].isdigit():
                found[name] = int(value.split()[0])
        return found

    found = lines(f"{proc}/{pid}/status")
    if "RssAnon" not in found:
        try:
            tasks = sorted(int(t) for t in os.listdir(f"{proc}/{pid}/task") if t.isdigit())
        except OSError:
            tasks = []
        for task in tasks:
            if "RssAnon" in (found := lines(f"{proc}/{pid}/task/{task}/status")):
                break
    return found


def _rss_anon(pid: int) -> int:
    """A process's resident anonymous memory in bytes (0 once it is gone)."""
    return memory_kb(pid).get("RssAnon", 0) << 10


def _pids(folder: Path) -> list[int]:
    return [int(p) for p in (_read(folder / "cgroup.procs") or "").split() if p.isdigit()]


def kill_inside(*folders: Path, timeout_s: float = 10.0) -> bool:
    """SIGKILL every process in ``folders`` until none is left (v2: ``cgroup.kill`` reaches a
    process however fast it forks); whether none is."""
    deadline = time.monotonic() + timeout_s
    while pids := [pid for folder in folders for pid in _pids(folder)]:
        if time.monotonic() > deadline:
            return False
        for folder in folders:
            if (folder / "cgroup.kill").exists():
                try:
                    (folder / "cgroup.kill").write_text("1")
                except OSError:
                    pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)
    return True


def remove_tree(folder: Path) -> None:
    """Kill what is inside ``folder`` and its children, then remove them, deepest first (a run's
    cgroup holds its ranks' and, on v2, ``grader``)."""
    if not folder.is_dir():
        return
    for child in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        kill_inside(child)
        rmdir(child)
    kill_inside(folder)
    rmdir(folder)


def rmdir(folder: Path) -> None:
    """Remove an emptied cgroup, waiting while its killed processes are reaped."""
    for _ in range(100):  # a killed process leaves its cgroup once its parent reaped it
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                return
            time.sleep(0.02)


_counter = [0]


@dataclass
class RankCgroups:
    """One test's ranks' memory cgroups, made by the grader (``make``) before its ranks start."""

    kind: str  # "cgroup v2" or "cgroup v1"
    folders: list[Path]

    @classmethod
    def make(cls, world_size: int) -> RankCgroups | None:
        """A cgroup per rank, or None where this grader can make none (the readings then fall back
        to the ranks' resident memory, outside.py)."""
        where = _kind_and_parent()
        if where is None:
            return None
        kind, parent = where
        _counter[0] += 1
        folders = [parent / f"rank-{os.getpid()}-{_counter[0]}-{r}" for r in range(world_size)]
        made = []
        try:
            for folder in folders:
                folder.mkdir()
                made.append(folder)
                if kind == "cgroup v1":  # socket buffers are counted only once this counter has a limit
                    try:
                        (folder / "memory.kmem.tcp.limit_in_bytes").write_text("-1")
                    except OSError:  # a kernel without it (kmem accounting off): the rest is still read
                        pass
                limit = folder / ("memory.max" if kind == "cgroup v2" else "memory.limit_in_bytes")
                limit.write_text(str(RANK_MEMORY_BYTES))  # no limit, no cgroup: a rank could take the host's memory
        except OSError:
            for folder in made:
                rmdir(folder)
            return None
        return cls(kind, folders)

    def name(self, rank: int) -> str:
        """The rank's cgroup as its own ``/proc/self/cgroup`` will show it once moved: its path
        below the mount point, after the cgroup the mount shows as its root."""
        folder = str(self.folders[rank])
        best = ("", "/")
        for line in (_read(Path("/proc/self/mountinfo")) or "").splitlines():
            left, _, right = line.partition(" - ")
            fields = left.split()
            if right.split()[:1] in (["cgroup"], ["cgroup2"]) and len(fields) > 4 and \
                    (folder + "/").startswith(fields[4].rstrip("/") + "/") and len(fields[4]) > len(best[0]):
                best = (fields[4], fields[3])
        below = folder[len(best[0].rstrip("/")):]
        return (best[1].rstrip("/") + below) or "/"

    def enter(self, rank: int, pid: int) -> None:
        """Grader side: move the rank's process into its cgroup (it waits for this)."""
        with open(self.folders[rank] / "cgroup.procs", "w") as f:
            f.write(str(pid))

    def read(self, rank: int) -> dict | None:
        """What the rank's cgroup holds now, in bytes (see the module): ``bytes`` the total charge,
        ``parts`` its processes' resident anonymous memory plus the file, kernel and socket
        charges, and each part. A page the rank shares with the fork server and first writes
        after its baseline (a copy on write) is charged to it then, while it was resident all
        along: the charge grows by it and ``parts`` does not (1.7 to 2.6 MB over a measured run
        before issue 57; a lazy import's reference counts charged 6.9 MB to one rank, which is why
        the fork server preloads what a submission imports and a rank imports what it declares
        before its baseline, preload.py). None if the cgroup cannot be read."""
        folder = self.folders[rank]
        stat = _stat(folder)
        if self.kind == "cgroup v2":
            current, peak = _read(folder / "memory.current"), _read(folder / "memory.peak")
            if current is None or not current.strip().isdigit() or not stat:
                return None
            kernel = stat["kernel"] if "kernel" in stat else sum(  # "kernel" since Linux 5.18; its parts before
                stat.get(k, 0) for k in ("kernel_stack", "pagetables", "sec_pagetables", "percpu", "slab"))
            parts = {"file": stat.get("file", 0), "kernel": kernel, "sock": stat.get("sock", 0)}
            charged, anon_charged = int(current), stat.get("anon", 0)
        else:
            usage, peak = _read(folder / "memory.usage_in_bytes"), _read(folder / "memory.max_usage_in_bytes")
            tcp, kernel = _read(folder / "memory.kmem.tcp.usage_in_bytes"), _read(folder / "memory.kmem.usage_in_bytes")
            if usage is None or not usage.strip().isdigit() or not stat:
                return None
            parts = {"file": stat.get("total_cache", stat.get("cache", 0)),
                     "kernel": int(kernel) if kernel and kernel.strip().isdigit() else 0,
                     "sock": int(tcp) if tcp and tcp.strip().isdigit() else 0}
            charged, anon_charged = int(usage) + parts["sock"], stat.get("total_rss", stat.get("rss", 0))
        processes = _pids(folder)
        anon = sum(_rss_anon(pid) for pid in processes)
        reading = {"bytes": charged, "parts": anon + sum(parts.values()), "anon": anon, **parts,
                   "anon_charged": anon_charged, "processes": len(processes), "source": self.kind}
        if peak and peak.strip().isdigit():
            reading["peak"] = int(peak)
        return reading

    def hit_limit(self, rank: int) -> bool:
        """Whether the rank's cgroup reached ``RANK_MEMORY_BYTES`` (the kernel then reclaims, and
        kills a process of it when nothing is left to reclaim)."""
        folder = self.folders[rank]
        if self.kind == "cgroup v2":
            events = dict(line.split() for line in (_read(folder / "memory.events") or "").splitlines() if " " in line)
            return int(events.get("oom_kill", 0)) > 0 or int(events.get("max", 0)) > 0
        failed = _read(folder / "memory.failcnt")
        return bool(failed and failed.strip().isdigit() and int(failed) > 0)

    def close(self) -> None:
        """Kill every process left in the ranks' cgroups (a double-forked helper too), remove them."""
        for folder in self.folders:
            remove_tree(folder)


def wait_until_moved(name: str, kind: str, timeout_s: float = MOVE_WAIT_S) -> None:
    """Rank side, before it joins its group: wait until the grader has moved this process into
    its cgroup ``name`` (``RankCgroups.name``), so that its first pause reads that cgroup."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = (_read(Path("/proc/self/cgroup")) or "").splitlines()
        for line in lines:
            number, controllers, path = line.split(":", 2)
            if path == name and ((kind == "cgroup v2" and number == "0") or "memory" in controllers.split(",")):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the grader did not move this rank into its memory cgroup {name} within "
                               f"{timeout_s:.0f} s (it is in: {'; '.join(lines)})")
        time.sleep(0.001)
