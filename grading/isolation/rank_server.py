"""The fork server's first act: become exactly as privileged as the ranks it will start.

multiprocessing's fork server imports its preload modules before it serves any request, and
ranks.py names this module first, so it runs before torch is imported and before the server
listens. Every process that can run what a submission sends is then at most as privileged as a
rank: a rank that reached the server (its socket is in a folder only the grader's uid can enter,
and, with namespaces, covered in the ranks' view) would get one more process like itself.

In that process (``GRADING_RANK_SERVER`` set, started as ``python -c``), in this order:
* with namespaces, the ranks' own view of the file systems (sandbox.rank_view);
* a limit on processes (RLIMIT_NPROC: a fork bomb stops there; it counts the uid's processes,
  the student uid's alone when the grader is root);
* as root, the switch to the student uid (student.become), then sandbox.confine: no capability,
  no new privileges, not dumpable;
* ``TMPDIR`` the submission's own (the grader's stays the grader's).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile

MAX_PROCESSES = 512  # threads count: a rank of torch and gloo holds a few dozen


def _paths(name: str) -> list[str]:
    return list(filter(None, os.environ.get(name, "").split(os.pathsep)))


def enter() -> None:
    from grading.isolation import sandbox, student

    if os.environ.get("GRADING_NETNS"):
        links = [tuple(pair) for pair in json.loads(os.environ.get("GRADING_RANK_LINKS") or "[]")]
        left = sandbox.rank_view(_paths("GRADING_WRITABLE"), _paths("GRADING_RANK_HIDDEN"), _paths("GRADING_RANK_KEEP"),
                                 links, os.environ.get("GRADING_RANK_SHM"))
        if left:
            print(f"grading sandbox: could not make read-only: {', '.join(left)}", flush=True)
    if os.environ.get("GRADING_STUDENT_UID") or os.environ.get("GRADING_NETNS"):  # else: the user's own count
        resource.setrlimit(resource.RLIMIT_NPROC, (MAX_PROCESSES, MAX_PROCESSES))
    sandbox.drop_bounding_set()
    if os.environ.get("GRADING_STUDENT_UID"):
        student.become(int(os.environ["GRADING_STUDENT_UID"]))
    sandbox.confine()
    os.environ["TMPDIR"] = os.environ.get("GRADING_RANK_TMPDIR", os.environ.get("TMPDIR", "/tmp"))
    tempfile.tempdir = None


if os.environ.get("GRADING_RANK_SERVER") and sys.argv[:1] == ["-c"]:
    try:
        enter()
    except BaseException as exc:  # noqa: BLE001 - the server must not serve unconfined (it ignores ImportError)
        print(f"grading: the fork server could not confine itself: {exc}", file=sys.stderr, flush=True)
        os._exit(70)
