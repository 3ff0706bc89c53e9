"""How one submission's run is contained, in each of the three ways a grader can run.

* **root** (Gradescope, CI, a course's server): the fork server and every rank run as a student
  uid of their own (student.py) that owns only the ranks' home (mode 0700) and may read, not
  write, the submission's scratch copy; the grader's files, OUT and other submissions' copies stay root's. Where root may
  also make namespaces (``unshare`` works: not in a default Docker container), the run has
  private network, mount, PID and IPC namespaces as well, and the ranks their own view of the file
  systems (sandbox.rank_view). At the end every process of the uid is killed at once, until
  none is left, and the files it left in world-writable folders are removed.
* **a user with user namespaces**: private user, network, mount and PID namespaces; the ranks'
  view as above; every process dies with the PID namespace, whose first process is killed and
  waited for (its exit waits for every other process in it).
* **a user without them**: its own session, resource limits, and every process carrying the
  run's token in its environment killed at the end; a rank can write what this user can write.
  Grade as root or where namespaces work for untrusted work.

``GRADING_NAMESPACES=0`` in the grader's environment turns namespaces off (the fallback that
Gradescope's containers get; the forgery tests use it to grade both ways on one machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from grading.isolation import share, student

REPOSITORY = Path(__file__).resolve().parents[2]  # the checkout (or Gradescope's source/) the grader runs from
# The run's own network, PID, mount and IPC namespaces: System V objects die with the run.
UNSHARE = ["unshare", "--net", "--pid", "--mount", "--ipc", "--mount-proc", "--fork", "--kill-child"]


def namespaces_available() -> bool:
    """Whether this grader can make the private namespaces it grades in (and is allowed to)."""
    if os.environ.get("GRADING_NAMESPACES") == "0" or shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run([*_unshare(), "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _unshare() -> list[str]:
    """Root makes the namespaces as itself (ranks become the student uid); a user, in a user namespace."""
    return UNSHARE if student.can_switch() else [UNSHARE[0], "--user", "--map-root-user", *UNSHARE[1:]]


def limit(memory_gb: float, cpu_s: int, open_files: int):
    """``resource`` limits for a process the harness starts (its preexec_fn)."""
    def apply() -> None:
        import resource
        for what, value in ((resource.RLIMIT_AS, int(memory_gb * (1 << 30))), (resource.RLIMIT_CPU, cpu_s),
                            (resource.RLIMIT_NOFILE, open_files), (resource.RLIMIT_FSIZE, 1 << 30),
                            (resource.RLIMIT_CORE, 0)):
            soft, hard = resource.getrlimit(what)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(what, (value, value))
    return apply


def kill_tagged(token: str) -> int:
    """SIGKILL every process whose environment carries ``GRADING_TOKEN=token``; how many."""
    needle = f"GRADING_TOKEN={token}".encode()
    killed = 0
    for _ in range(3):  # a process may fork while we look
        found = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        os.kill(int(pid), signal.SIGKILL)
                        found += 1
            except (OSError, ProcessLookupError):
                continue
        killed += found
        if not found:
            break
        time.sleep(0.2)
    return killed


class ContainmentError(RuntimeError):
    """The run cannot be contained as this grader must contain it; the message says why."""


@dataclass
class Containment:
    token: str
    namespaces: bool
    student: student.Student | None = None
    notes: list[str] = field(default_factory=list)
    share: share.Share = field(default_factory=share.Share)

    @classmethod
    def start(cls, token: str) -> Containment:
        return cls(token, namespaces_available(), student.claim() if student.can_switch() else None,
                   share=share.make(token))

    def preexec(self, limits):
        """The run's first process: its resource limits, then into the run's cgroup (share.py)."""
        def apply() -> None:
            limits()
            self.share.enter()
        return apply

    def describe(self) -> str:
        parts = ["scratch copy, scrubbed environment, resource limits", self.share.describe()]
        if self.student:
            parts.append(f"ranks as uid {self.student.uid} (owns only its home; the submission's copy read-only)")
        if self.namespaces:
            parts.append("private network, mount, PID and IPC namespaces, read-only file systems but its home, a private /dev")
            parts.append("the bytes the ranks carry read by the grader from their own loopback (FSDP's phases, overlap)")
        else:
            parts.append("no loopback of their own: the bytes the ranks carry are not read")
        return ", ".join(parts)

    def guarantees(self, private_storage: bool) -> str:
        """grade.md's first line: which of the sealed rank's guarantees held on this grader
        (grading/README.md, "What each mode guarantees")."""
        held = [("storage", "each rank's storage a bounded tmpfs of its own, charged to its memory" if private_storage
                 else "no storage of each rank's own: the files its uid holds on disk are read with its memory"),
                ("memory", "each rank's memory read from its own memory cgroup, every process and task in it"
                 if self.share.memory else "no memory cgroup: each rank's memory read from /proc, its processes only"),
                ("traffic", "the bytes ranks carry read from their own loopback" if self.namespaces
                 else "no loopback of their own: the bytes they carry are not read"),
                ("calls", "the calls of the kernel policy refused in every rank, on every thread (grading/isolation/policy.py)"),
                ("witnesses", "what the submission's code does witnessed by audit hooks in every rank")]
        return "Guarantees on this grader: " + "; ".join(text for _, text in held) + "."

    def command(self, argv: list[str]) -> list[str]:
        return [*_unshare(), *argv] if self.namespaces else argv

    def env(self) -> dict[str, str]:
        env = {"GRADING_NETNS": "1"} if self.namespaces else {}
        if self.student:
            env["GRADING_STUDENT_UID"] = str(self.student.uid)
        return {**env, **self.share.env()}

    def hand_over(self, scratch: Path, writable: list[Path], out: Path, hidden: list[Path],
                  keep: list[Path], readable: list[Path] = ()) -> dict[str, str]:
        """As root: the writable folders become the student uid's (0700), the scratch folder may
        be entered but not listed, and OUT's folder is root's alone. The variables that tell the
        fork server what the ranks' view covers and what it keeps in sight under those folders
        (the grader's copy, Python and its packages; a folder on their way that other users may
        not enter is covered too, so that the student uid reaches what it needs)."""
        python = python_folders()
        if self.student:
            for folder in writable:
                student.give(folder, self.student.uid)
            for folder in readable:
                student.lend(folder)
            os.chmod(scratch, 0o711)
            os.chmod(out, 0o700)
        keep_real = sorted({os.path.realpath(p) for p in [*keep, *python] if os.path.exists(p)})
        closed = sorted({a for p in keep_real for a in _closed_ancestors(p)  # the student's own it may enter
                         if not (self.student and os.stat(a).st_uid == self.student.uid)})
        if self.student and closed and not self.namespaces:
            raise ContainmentError(f"the student uid cannot enter {closed[0]} (on the way to Python or its "
                                   "packages): install them where any user can read them, or grade with namespaces")
        links = sorted({link for p in [*keep, *python] for link in _links_on_the_way(str(p))})
        return {"GRADING_RANK_HIDDEN": os.pathsep.join([*(os.path.realpath(p) for p in hidden), *closed]),
                "GRADING_RANK_KEEP": os.pathsep.join(keep_real), "GRADING_RANK_LINKS": json.dumps(links)}

    def stop(self, proc: subprocess.Popen) -> None:
        """Kill every process of the run; returns only once none is left (raises if one is)."""
        if self.namespaces and not self.student:
            self._stop_namespace(proc)
        else:
            with_signal(os.killpg, proc.pid)
        proc.wait()
        if self.student:
            if not student.kill_all(self.student.uid):
                raise RuntimeError(f"processes of uid {self.student.uid} survived SIGKILL")
        else:
            kill_tagged(self.token)
        if not self.share.kill_all():  # any session, uid or environment: it is in the run's cgroup
            raise RuntimeError(f"processes in {self.share.folders[0]} survived SIGKILL")
        if self.student:
            student.remove_files(self.student.uid)

    def _stop_namespace(self, proc: subprocess.Popen) -> None:
        """The PID namespace's first process killed; unshare returns once its exit is reaped, and
        that exit waits until every other process of the namespace is gone."""
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            children = []
        for pid in children:
            with_signal(os.kill, int(pid))
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with_signal(os.killpg, proc.pid)

    def release(self) -> None:
        self.share.kill_all()
        self.share.remove()
        if self.student:
            student.release(self.student)


COURSE_PACKAGES = ("cs336_systems", "cs336_basics", "grading", "tests")
MAX_LINKS_READ = 20_000  # entries of a site-packages folder looked at for links


def package_paths() -> list[str]:
    """Import folders of this Python beyond the interpreter's own: ``PYTHONPATH`` entries and
    folders a ``.pth`` file adds (a cluster's packages carried in ``/tmp/site``, say), without
    the working folder, the grader's own checkout (``REPOSITORY``) and any folder holding a
    package a submission brings itself (``COURSE_PACKAGES``): a rank must never import ours in
    place of a submission's. The harness hands them to the suite and the ranks
    (``GRADING_PACKAGE_PATHS``)."""
    own = [os.path.realpath(p) for p in [*sysconfig.get_paths().values(), *site.getsitepackages()]]
    skip = [os.path.realpath(REPOSITORY)]
    found: list[str] = []
    for entry in sys.path:
        real = os.path.realpath(entry) if entry else ""
        if not real or not os.path.isdir(real) or real in found or any(_inside(real, f) for f in own + skip) \
                or any(os.path.exists(os.path.join(real, name)) for name in COURSE_PACKAGES):
            continue
        found.append(real)
    return found


def python_folders() -> list[str]:
    """Every folder the interpreter and its packages live in, as the ranks must see them: the
    prefixes, the interpreter's folder, the install paths, ``package_paths``, and where the
    entries of site-packages that are links lead (a virtual environment whose packages link
    into another environment, as some course images and tests build them)."""
    folders = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
               *sysconfig.get_paths().values(), *site.getsitepackages(), *package_paths()]
    for packages in site.getsitepackages():
        try:
            with os.scandir(packages) as entries:
                for n, entry in enumerate(entries):
                    if n >= MAX_LINKS_READ:
                        break
                    if entry.is_symlink() and os.path.exists(entry.path):
                        folders.append(os.path.dirname(os.path.realpath(entry.path)))
        except OSError:
            continue
    return folders


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _links_on_the_way(path: str) -> list[tuple[str, str]]:
    """(link, where it leads) for each symbolic link on the way to ``path``: the interpreter's
    paths name them (a ``.venv`` that links to another environment), and a covered folder that
    held one must hold it again in the ranks' view (sandbox.relink)."""
    links, here = [], os.path.abspath(path)
    while here != os.path.dirname(here):
        if os.path.islink(here):
            links.append((here, os.path.realpath(here)))
        here = os.path.dirname(here)
    return links


def _closed_ancestors(path: str) -> list[str]:
    """The folders on the way to ``path`` (itself included) that other users may not enter."""
    closed, here = [], path
    while here != os.path.dirname(here):
        try:
            if os.path.isdir(here) and not os.stat(here).st_mode & 0o001:
                closed.append(here)
        except OSError:
            pass
        here = os.path.dirname(here)
    return closed


def with_signal(kill, pid: int) -> None:
    try:
        kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
