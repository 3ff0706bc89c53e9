"""Reading and copying a submission's files as root: no link kept or followed, regular files only, bounded.

The harness runs as root (Gradescope, a course's server) and a submission names its files: a
``pyproject.toml`` that is a link to ``/dev/zero`` would fill the harness's memory, one to
``/proc/self/fd/0`` would block it, one to ``/proc/self/fd/N`` would read another grading's pipe.
So the scratch copy holds folders and regular files only (links, FIFOs, devices and sockets are
dropped when a checkout is copied, as when a zip is unpacked), every file is opened without
following a link and checked to be regular on its descriptor, and every read is bounded. All of
it runs in a limited subprocess (intake.py), never in the process that records grades.
"""

from __future__ import annotations

import os
import shutil
import stat
import zipfile
from pathlib import Path

MAX_UNPACKED_BYTES = 2 << 30
MAX_FILES = 50_000  # a tree with more is refused, before anything else looks at it
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", "node_modules", "wandb", ".mypy_cache"}
MAX_FILE_BYTES = 64 << 20  # larger files (checkpoints, data) are left out of the scratch copy
MAX_TEXT_BYTES = 4 << 20  # a file the harness itself reads (adapters, pyproject.toml, .gitmodules)
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO does not wait


class TreeTooLarge(ValueError):
    """A submission's tree beyond the limits; the message is the grade's one line."""


def read_regular(path: Path, max_bytes: int = MAX_TEXT_BYTES) -> bytes:
    """The bytes of ``path`` if it is a regular file, opened without following a link (its last
    component; the scratch copy holds no link above it) and without blocking on a FIFO; at most
    ``max_bytes`` (more is an OSError). A link to /dev/zero, a FIFO or /proc/self/fd/0 is refused,
    never read."""
    fd = os.open(path, OPEN_FLAGS)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path.name} is not a regular file")
        if info.st_size > max_bytes:
            raise OSError(f"{path.name} is larger than {max_bytes} bytes")
        data = os.read(fd, max_bytes + 1)
        if len(data) > max_bytes:
            raise OSError(f"{path.name} is larger than {max_bytes} bytes")
        return data
    finally:
        os.close(fd)


def _copy_folder(submission: Path, dest: Path) -> list[str]:
    """A checkout copied as the zip path unpacks: folders and regular files only (links, FIFOs,
    devices and sockets dropped, never followed or opened), each opened without following a link
    and copied from its descriptor, so what is copied is what was checked. The paths dropped."""
    dropped: list[str] = []
    count = total = 0
    for folder, dirs, files in os.walk(submission, followlinks=False):
        here = Path(folder)
        target = dest / here.relative_to(submission)
        target.mkdir(parents=True, exist_ok=True)
        count += len(dirs) + len(files)
        if count > MAX_FILES:
            raise TreeTooLarge(f"{submission.name} has more than {MAX_FILES} files")
        kept = []
        for name in dirs:
            if (here / name).is_symlink():
                dropped.append(str((here / name).relative_to(submission)))
            elif name not in SKIP_DIRS:
                kept.append(name)
        dirs[:] = kept
        for name in files:
            if name.endswith(".pyc"):
                continue
            try:
                fd = os.open(here / name, OPEN_FLAGS)
            except OSError:  # a link (ELOOP), or gone
                dropped.append(str((here / name).relative_to(submission)))
                continue
            with os.fdopen(fd, "rb") as src:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    dropped.append(str((here / name).relative_to(submission)))
                    continue
                if info.st_size > MAX_FILE_BYTES:
                    continue
                total += info.st_size
                if total > MAX_UNPACKED_BYTES:
                    raise TreeTooLarge(f"{submission.name} holds more than {MAX_UNPACKED_BYTES >> 30} GiB")
                with open(target / name, "wb") as out:
                    shutil.copyfileobj(src, out, length=1 << 20)
    return dropped


def unpack(submission: Path, dest: Path) -> list[str]:
    """Copy a checkout, or unpack a zip, into ``dest``: folders and regular files only, no link
    kept or followed, no path outside it; at most MAX_FILES files and MAX_UNPACKED_BYTES bytes.
    The paths of links and special files dropped."""
    if submission.is_dir():
        return _copy_folder(submission, dest)
    dropped: list[str] = []
    dest.mkdir(parents=True)
    with zipfile.ZipFile(submission) as z:
        total = 0
        if len(z.infolist()) > MAX_FILES:
            raise TreeTooLarge(f"{submission.name} has more than {MAX_FILES} files")
        for info in z.infolist():
            target = (dest / info.filename).resolve()
            if not str(target).startswith(str(dest.resolve()) + os.sep) or info.is_dir():
                continue
            if (info.external_attr >> 16) & 0o170000 == 0o120000:  # a symbolic link
                dropped.append(info.filename)
                continue
            total += info.file_size
            if total > MAX_UNPACKED_BYTES:
                raise TreeTooLarge(f"{submission.name} unpacks to more than {MAX_UNPACKED_BYTES >> 30} GiB")
            if info.file_size > MAX_FILE_BYTES or any(part in SKIP_DIRS for part in Path(info.filename).parts):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
    return dropped
