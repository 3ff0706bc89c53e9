"""Grade as Gradescope's containers do: as root, without namespaces (``GRADING_NAMESPACES=0``).

Run by tests/test_grading_hostile.py under ``unshare --mount`` (root only): a container's Python
is readable by any user, and this machine's may sit in a folder only root may enter (``/root``),
so those folders are covered here, in this process's own mount namespace, with Python and its
packages bound back in (sandbox.cover), before the grader starts. Nothing else differs from a
grader run in such a container.

    python -m tests.fallback_grade '{"folder": ..., "out": ..., "only": [...], "select": ...}'

prints one JSON line: per graded submission, its points per problem, its tests' runs and
outputs, its seconds.
"""

from __future__ import annotations

import json
import os
import site
import sys
import sysconfig
from pathlib import Path

os.environ["GRADING_NAMESPACES"] = "0"

from grading.isolation import sandbox  # noqa: E402
from grading.isolation.containment import REPOSITORY, _closed_ancestors  # noqa: E402
from grading.course.course import grade_folder  # noqa: E402
from grading.harness import Limits, grade  # noqa: E402


def open_python() -> None:
    """Python, its packages and the grader's checkout (a container's image has them readable by
    any user) kept in sight under the folders covered here."""
    python = {os.path.realpath(p) for p in [sys.prefix, sys.base_prefix, *sysconfig.get_paths().values(),
                                            *site.getsitepackages(), REPOSITORY] if os.path.exists(p)}
    closed = sorted({a for p in python for a in _closed_ancestors(p)} - python)
    sandbox.cover(closed, sorted(python))


def summary(graded) -> dict:
    return {"points": {r.problem: r.points for r in graded.rows if r.points is not None},
            "runs": [t.runs for t in graded.tests], "outputs": [t.output for t in graded.tests],
            "seconds": graded.seconds, "note": graded.note}


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    open_python()
    limits = Limits(test_timeout_s=args["test_timeout_s"], submission_timeout_s=args["submission_timeout_s"])
    only, select = tuple(args["only"]), args["select"]
    if args.get("folder"):
        graded = grade_folder(Path(args["folder"]), Path(args["out"]), 1, args["edition"], limits, args["jobs"],
                              only, select, quiet=True)
    else:
        graded = [grade(Path(args["submission"]), Path(args["out"]), 1, args["edition"], limits, quiet=True,
                        only=only, select=select)]
    print(json.dumps({g.name: summary(g) for g in graded}))
