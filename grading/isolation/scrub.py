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
import stat

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
        if entry.name not in keep:
            remove_tree(entry.path)


REMOVE_BUDGET = 2_000_000  # entries one removal visits at most: a rank's storage holds far fewer


def remove_tree(path: str) -> bool:
    """Remove ``path`` and everything below it, however deep, never following a link and never
    raising; whether it is gone. A tree a rank left may be deeper than any recursion (shutil's
    rmtree raised RecursionError, ``ignore_errors`` or not, on a 5000-deep one) or than a path
    can name, so no step recurses or builds a path: each pass empties the folders directly below
    ``path``, moving their own folders up into ``path`` (a rename between two open folders), and
    the next pass empties those; at most two folders are open at once."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            return True
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return not os.path.lexists(path)
    visited, moved = 0, 0
    try:
        while visited < REMOVE_BUDGET:
            with os.scandir(top) as found:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in found]
            if not entries:
                break
            progress = False
            for name, is_dir in entries:
                visited += 1
                if not is_dir:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=top)
                        progress = True
                    continue
                try:
                    inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
                except OSError:
                    continue
                try:
                    with os.scandir(inner) as below:
                        children = [(e.name, e.is_dir(follow_symlinks=False)) for e in below]
                    for child, child_is_dir in children:
                        visited += 1
                        with contextlib.suppress(OSError):
                            if child_is_dir:
                                moved += 1
                                os.rename(child, f".removing-{os.getpid()}-{moved}", src_dir_fd=inner, dst_dir_fd=top)
                            else:
                                os.unlink(child, dir_fd=inner)
                finally:
                    os.close(inner)
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=top)
                    progress = True
            if not progress:
                break
    except Exception:  # noqa: BLE001 - a clean-up never stops the grading after it
        pass
    finally:
        os.close(top)
    with contextlib.suppress(OSError):
        os.rmdir(path)
    return not os.path.lexists(path)


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
