"""The student uid: a uid of its own for every process that runs a submission's code (grader as root).

When the grader runs as root (Gradescope's containers, CI), the fork server that starts a
submission's ranks, and so every rank, switches to an unprivileged uid that no account and no
other running grading holds (``claim``: a free uid from a range far above any account's, held
by an ``flock`` for as long as the grading runs, so that parallel gradings, in threads or in
separate processes, never share one). That uid owns only the submission's scratch copy and home;
it can write no file the grader reads or writes, open no descriptor of a root process, and
signal none.

At the end every process of that uid is killed at once (``kill_all``: a child that becomes the
uid sends ``kill(-1, SIGKILL)``, which reaches every process of that uid in one step, however
fast they fork), until none is left; and what the uid left in the world-writable folders
(``/tmp``, ``/dev/shm``...) is removed (``remove_files``: each folder scanned on its own, with a
budget the uid cannot spend).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from grading.isolation import scrub

FIRST_UID, UIDS = 1_800_000_000, 100_000_000  # far above any account's uid, below 2^31
LOCKS = Path(tempfile.gettempdir()) / "grading-student-uids"
SHARED_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")
MAX_ENTRIES = 100_000  # entries of other owners scanned per shared folder when removing what a uid left


@dataclass
class Student:
    uid: int
    lock_fd: int


def can_switch() -> bool:
    """Whether the grader can run a submission's processes as another uid (it is root)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def claim() -> Student:
    """A uid no account, file lock or running process holds; held until ``release``."""
    with contextlib.suppress(FileExistsError):
        LOCKS.mkdir(mode=0o700)
    folder = os.open(LOCKS, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)  # never a link someone left there
    try:
        os.fchown(folder, 0, 0)
        os.fchmod(folder, 0o700)
        for _ in range(100):
            uid = FIRST_UID + random.randrange(UIDS)
            fd = os.open(str(uid), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600, dir_fd=folder)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if not _account(uid) and not processes(uid):
                return Student(uid, fd)
            os.close(fd)
    finally:
        os.close(folder)
    raise RuntimeError("no free uid to run the submission as")


def release(student: Student) -> None:
    os.close(student.lock_fd)


def _account(uid: int) -> bool:
    import pwd

    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def processes(uid: int) -> list[int]:
    """Every process whose real, effective, saved or file-system uid is ``uid``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        except (OSError, StopIteration):
            continue
        if str(uid) in uids:
            found.append(int(pid))
    return found


def become(uid: int) -> None:
    """Switch this process to ``uid`` for good (no supplementary group, gid = uid)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid):
        raise RuntimeError(f"could not become uid {uid}")


def kill_all(uid: int, timeout_s: float = 30.0) -> bool:
    """SIGKILL every process of ``uid`` until none is left; whether none is (within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while processes(uid):
        if time.monotonic() > deadline:
            return False
        pid = os.fork()
        if pid == 0:  # the killer: becomes the uid, so kill(-1) reaches exactly that uid's processes
            try:
                become(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.05)  # killed processes leave /proc once their parent reaps them
    return True


def disk_bytes(uid: int, folders: list[str], budget: int = 4 * MAX_ENTRIES) -> int | None:
    """What ``uid``'s files hold on the storage under ``folders`` and the shared folders, in bytes
    (allocated blocks: a sparse file holds only what it wrote), entering only the folders it may
    write in (its own, or anyone's); None past ``budget`` entries, too many to read at a pause.
    Where ranks have no tmpfs of their own (no user namespace), a file synced and dropped from the
    page cache is in no memory reading: this is its reading (outside.read_stopped)."""
    total, seen, queue = 0, 0, [f for f in [*folders, *SHARED_FOLDERS] if os.path.isdir(f) and not os.path.islink(f)]
    while queue:
        folder = queue.pop()
        try:
            entries = os.scandir(folder)
        except OSError:
            continue
        with entries:
            for entry in entries:
                seen += 1
                if seen > budget:
                    return None
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(info.st_mode):
                    if info.st_uid == uid or info.st_mode & 0o002:
                        queue.append(entry.path)
                elif info.st_uid == uid and stat.S_ISREG(info.st_mode):
                    total += info.st_blocks * 512
    return total


def remove_files(uid: int) -> list[str]:
    """Remove what ``uid`` left in the world-writable folders; the paths removed.

    The uid can create entries only in folders anyone may write (or in its own, removed whole),
    so only those are entered. Each shared folder is scanned on its own, and only entries of
    other owners spend its budget (MAX_ENTRIES): those the uid cannot make, so it cannot spend
    the budget. Each entry of the uid is removed as it is met, however many there are (100,001
    files in /run/lock once spent a budget shared by every folder, and /dev/shm and /tmp were
    never scanned: 1.2 GB outlived the grading)."""
    removed: list[str] = []
    for top in SHARED_FOLDERS:
        if os.path.isdir(top) and not os.path.islink(top):
            removed += _remove_in(top, uid)
    return removed


def _remove_in(top: str, uid: int) -> list[str]:
    removed: list[str] = []
    queue, foreign = [top], 0
    while queue and foreign < MAX_ENTRIES:
        folder = queue.pop()
        try:
            entries = os.scandir(folder)
        except OSError:
            continue
        with entries:
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if info.st_uid == uid:
                    if stat.S_ISDIR(info.st_mode):
                        scrub.remove_tree(entry.path)  # no link followed, any depth
                    else:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                    removed.append(entry.path)
                    continue
                foreign += 1
                if stat.S_ISDIR(info.st_mode) and info.st_mode & 0o002:
                    queue.append(entry.path)
    return removed


def lend(path: Path) -> None:
    """Let every uid read ``path`` and everything under it, and none but its owner write it
    (folders 0755, files 0644, or 0755 where the owner may run them; links are not followed)."""
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o755, follow_symlinks=False)
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                os.chmod(full, 0o755 if os.stat(full).st_mode & 0o100 else 0o644)
    os.chmod(path, 0o755)


def give(path: Path, uid: int, mode: int = 0o700) -> None:
    """Make ``path`` and everything under it the uid's (links themselves, never their targets);
    ``path`` itself gets ``mode``, so that no other uid can enter it."""
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [*dirnames, *filenames]:
            os.chown(os.path.join(dirpath, name), uid, uid, follow_symlinks=False)
    os.chown(path, uid, uid, follow_symlinks=False)
    os.chmod(path, mode)
