"""What a test's ranks leave behind is gone before the next test starts: no storage outlives its test.

A memory cgroup is charged for a page when a process first touches it; a file or a shared-memory
segment that one test's rank wrote stays charged to that test's (removed) cgroup, and a later
test's rank that maps it keeps state there that its own reading never shows. So after every
test's ranks are gone (ranks.run_ranks), the grader removes, as the grader:

* every entry of the ranks' home (``HOME``: the only folder they may write; the submission's
  copy is read-only to them) but the folders of their temporary files and of their
  ``/dev/shm`` (``GRADING_RANK_SHM``, with namespaces), which it empties;
* System V shared memory, semaphores and message queues: in the run's own IPC namespace, every
  one (the run is their only user); as root without namespaces, the student uid's;
* as root without namespaces, what the student uid left in the world-writable folders
  (``/tmp``, ``/dev/shm``, …: student.remove_files).

A grader run by hand, on this checkout, has no home of the ranks' and removes nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil

IPC_RMID = 0
SYSV = {"shm": "shmctl", "sem": "semctl", "msg": "msgctl"}


def ipc_objects(kind: str) -> list[tuple[int, int]]:
    """(id, owner uid) of every System V object of ``kind`` ("shm", "sem", "msg") this IPC
    namespace holds, from /proc/sysvipc."""
    found = []
    try:
        with open(f"/proc/sysvipc/{kind}") as f:
            header = f.readline().split()
            for line in f:
                fields = dict(zip(header, line.split()))
                found.append((int(fields["shmid" if kind == "shm" else "semid" if kind == "sem" else "msqid"]),
                              int(fields["uid"])))
    except (OSError, KeyError, ValueError):
        pass
    return found


def remove_ipc(uid: int | None) -> int:
    """Remove every System V object (``uid``: only that owner's); how many were removed."""
    libc = ctypes.CDLL(None, use_errno=True)
    removed = 0
    for kind, call in SYSV.items():
        for ident, owner in ipc_objects(kind):
            if uid is None or owner == uid:
                args = (ident, 0, IPC_RMID, None) if kind == "sem" else (ident, IPC_RMID, None)
                removed += getattr(libc, call)(*args) == 0
    return removed


def empty(folder: str, keep: tuple[str, ...] = ()) -> None:
    """Remove every entry of ``folder`` but those named in ``keep``, never following a link."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.name in keep:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def rank_home() -> str | None:
    """The ranks' home in a grading run's layout (``HOME``, holding their TMPDIR); None for a
    grader run by hand, on this checkout, where nothing is the ranks' own."""
    tmp, home = os.environ.get("GRADING_RANK_TMPDIR"), os.environ.get("HOME")
    if not tmp or not home or os.path.dirname(os.path.realpath(tmp)) != os.path.realpath(home):
        return None
    return home


def after_test() -> None:
    """What the ranks of the test that just ended left, removed (see the module)."""
    home = rank_home()
    if home is None:
        return
    tmp = os.environ["GRADING_RANK_TMPDIR"]
    shm = os.environ.get("GRADING_RANK_SHM")
    kept = [folder for folder in (tmp, shm) if folder and os.path.dirname(os.path.realpath(folder)) == os.path.realpath(home)]
    empty(home, keep=tuple(os.path.basename(k) for k in kept))
    for folder in kept:
        empty(folder)
    uid = os.environ.get("GRADING_STUDENT_UID")
    if os.environ.get("GRADING_NETNS"):
        remove_ipc(None)
    elif uid:
        from grading.isolation import student

        remove_ipc(int(uid))
        student.remove_files(int(uid))
