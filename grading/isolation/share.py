"""A CPU share and a task limit for one submission's run: a cgroup of its own where the grader may make one.

Submissions graded at once (``--jobs``) must not take each other's CPU. The kernel's scheduler
shares CPU between sessions (autogroup) or between cgroups, not between submissions: a
submission that forks busy loops, each ``setsid()`` into a session of its own, got a share per
loop and starved a correct neighbour to 0/35 (issue 38). So the whole run (the grader's pytest,
the fork server, every rank and whatever they start, in any session) is put into a cgroup of
its own before it starts: the same CPU weight as every other submission's (cgroup v2
``cpu.weight``, v1 ``cpu.shares``; inside a cgroup, autogroup does not apply) and at most
``MAX_TASKS`` tasks (``pids.max``). At the end every process left in it is killed, whatever its
session, uid or environment, and the cgroup removed.

Where the memory controller can be had as well, the run's cgroup is also the parent of its
ranks' memory cgroups (rank_cgroups.py: each rank's memory read from the kernel's charge). On
cgroup v2 a cgroup that hands a controller to its children may hold no process of its own, so
there the run's processes go into a child, ``grader``, and the ranks' cgroups are its siblings;
on v1 the memory hierarchy gets a cgroup for the run beside the cpu and pids ones.

Where no cgroup can be made (a user without delegation, a read-only ``/sys/fs/cgroup``), the run
gets the resource limits alone (RLIMIT_NPROC for the student uid, RLIMIT_CPU per process) and
``describe`` says so: grade one submission at a time there (``--jobs 1``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from grading.isolation import rank_cgroups

CGROUP = Path("/sys/fs/cgroup")
MAX_TASKS = 4096  # a run of world size 3: pytest, the fork server and three ranks of torch and gloo threads
V1_SHARES, V2_WEIGHT = 1024, 100  # the defaults: every submission's run weighs the same


@dataclass
class Share:
    folders: list[Path] = field(default_factory=list)  # the run's cgroup, one per hierarchy that has one
    kind: str = ""  # "cgroup v2", "cgroup v1", or "" (none could be made)
    memory: Path | None = None  # the parent of the ranks' memory cgroups (one of ``folders``), if any
    entry: list[Path] = field(default_factory=list)  # where the run's first process goes (v2 with memory: grader/)

    def describe(self) -> str:
        memory = (f"; each rank's memory read from a memory cgroup of its own ({self.kind})" if self.memory else
                  "; no memory cgroup: each rank's memory read from /proc (the resident memory of its processes)")
        if not self.folders:
            return f"no CPU share of its own (no writable cgroup: grade one submission at a time){memory}"
        return f"a CPU share and at most {MAX_TASKS} tasks of its own ({self.kind}){memory}"

    def env(self) -> dict[str, str]:
        """What tells the grader's pytest where to make its ranks' memory cgroups (rank_cgroups.ENV)."""
        if self.memory is None:
            return {}
        return {rank_cgroups.ENV: f"{self.kind[-2:]}:{self.memory}"}

    def enter(self) -> None:
        """Move this process (a preexec_fn: the run's first process) into the run's cgroups."""
        for folder in self.entry or self.folders:
            with open(folder / "cgroup.procs", "w") as f:
                f.write(str(os.getpid()))

    def pids(self) -> set[int]:
        """Every process in the run's cgroups and their children (the grader's, the ranks')."""
        found: set[int] = set()
        for top in self.folders:
            for folder in [top, *(p for p in top.rglob("*") if p.is_dir())]:
                try:
                    found |= {int(p) for p in (folder / "cgroup.procs").read_text().split()}
                except (OSError, ValueError):
                    continue
        return found

    def kill_all(self, timeout_s: float = 30.0) -> bool:
        """SIGKILL every process in the run's cgroups until none is left; whether none is."""
        return rank_cgroups.kill_inside(*self._tree(), timeout_s=timeout_s)

    def remove(self) -> None:
        for folder in reversed(self._tree()):  # the deepest first
            rank_cgroups.rmdir(folder)

    def _tree(self) -> list[Path]:
        """The run's cgroups and every cgroup inside them, each after its parent."""
        return sorted((f for top in self.folders for f in [top, *(p for p in top.rglob("*") if p.is_dir())]),
                      key=lambda p: len(p.parts))


def _v1_mount(controller: str) -> Path | None:
    """Where the v1 hierarchy of ``controller`` is mounted, if its root is this namespace's."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, right = line.split(" - ", 1)
        fields, kind = left.split(), right.split()
        if kind[0] == "cgroup" and controller in kind[2].split(",") and fields[3] == "/":
            return Path(fields[4])
    return None


def _remove_stale(parent: Path) -> None:
    """The runs' cgroups that a killed grader left (named ``grading-<its pid>-…``, that pid gone),
    with the cgroups inside them (its ranks'), every process still in them killed; no live
    grader's is touched."""
    for stale in parent.glob("grading-*"):
        parts = stale.name.split("-")
        if len(parts) == 3 and parts[1].isdigit() and not os.path.exists(f"/proc/{parts[1]}"):
            rank_cgroups.remove_tree(stale)


def _make(folder: Path, settings: dict[str, str]) -> bool:
    _remove_stale(folder.parent)
    try:
        folder.mkdir()
    except OSError:
        return False
    try:
        for name, value in settings.items():
            (folder / name).write_text(value)
        return True
    except OSError:
        folder.rmdir()
        return False


def make(token: str) -> Share:
    """The run's cgroup beside this grader's own (where it may make one), else an empty Share."""
    name = f"grading-{os.getpid()}-{token[:12]}"
    if (CGROUP / "cgroup.controllers").exists():  # v2
        own = rank_cgroups.own_path(None)
        parent = CGROUP / (own or "/").lstrip("/")
        try:
            enabled = (parent / "cgroup.subtree_control").read_text().split()
        except OSError:
            enabled = []
        if own is not None and {"cpu", "pids"} <= set(enabled) and \
                _make(parent / name, {"cpu.weight": str(V2_WEIGHT), "pids.max": str(MAX_TASKS)}):
            run = parent / name
            if "memory" in enabled and _make(run / "grader", {}):
                try:
                    (run / "cgroup.subtree_control").write_text("+memory")
                    return Share([run], "cgroup v2", memory=run, entry=[run / "grader"])
                except OSError:
                    (run / "grader").rmdir()
            return Share([run], "cgroup v2")
        return Share()
    made = []
    for controller, settings in (("cpu", {"cpu.shares": str(V1_SHARES)}), ("pids", {"pids.max": str(MAX_TASKS)})):
        mount, own = _v1_mount(controller), rank_cgroups.own_path(controller)
        if mount is None or own is None:
            continue
        folder = mount / own.lstrip("/") / name
        if _make(folder, settings):
            made.append(folder)
    if len(made) < 2:
        Share(made).remove()
        return Share()
    mount, own = _v1_mount("memory"), rank_cgroups.own_path("memory")
    if mount is not None and own is not None and _make(mount / own.lstrip("/") / name, {}):
        return Share([*made, mount / own.lstrip("/") / name], "cgroup v1", memory=mount / own.lstrip("/") / name)
    return Share(made, "cgroup v1")
