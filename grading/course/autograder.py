"""``make autograder``: ``autograder.zip``, ready to upload to Gradescope.

Gradescope (https://gradescope-autograders.readthedocs.io/en/latest/specs/) unpacks the zip into
``/autograder/source`` and runs ``setup.sh`` there once, when it builds the image; for each
submission it copies ``run_autograder`` to ``/autograder/run_autograder``, starts that copy from
``/autograder`` with the student's files in ``/autograder/submission``, and reads
``/autograder/results/results.json``. The zip holds:

* ``grading/``: this grader, with ``COMMIT`` (the commit it was built from: grade.md and
  results.json name it) and ``EDITION``, the course's edition, pinned when the package is built
  (``make autograder EDITION=2026|2025``): every submission is graded against that edition's
  rubric, out of its total; one that answers the other edition's adapters is flagged in grade.md;
* ``requirements.txt``: every package of this repository's lock that grading needs, as locked,
  but torch and the CUDA libraries (Gradescope's machines have no GPU);
* ``setup.sh``: a virtual environment in ``ROOT/venv`` with the locked torch version's CPU build
  (from PyTorch's CPU index) and ``requirements.txt``; what it installed goes to
  ``source/installed.txt``. It stops with one line when the index cannot be reached;
* ``run_autograder``: grades ``ROOT/submission`` into ``ROOT/results`` with ``ROOT/venv``'s
  Python and ``ROOT/source`` as the only path to the grader, wherever it is started from.
  ``ROOT`` is the folder of the copy Gradescope starts (``AUTOGRADER_ROOT`` overrides it);
  ``REPEATS`` (default ``DEFAULT_REPEATS``) and ``TIME_LIMIT`` (seconds, default
  ``DEFAULT_TIME_LIMIT_S``: inside Gradescope's 10 minutes) may be set in the environment.

    python -m grading.course.autograder autograder.zip [2026|2025]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from grading.harness import GRADER_DIR, grader_commit

ROOT = GRADER_DIR.parent
LEFT_OUT = ("torch", "nvidia-", "cuda-")  # the CPU build of torch comes from its own index

DEFAULT_REPEATS = 2  # runs per test: fits Gradescope's 10 minutes at half a CPU (grading/README.md, "Gradescope")
DEFAULT_TIME_LIMIT_S = 540  # the whole submission: results are written before Gradescope's 10 minutes
COURSE_EDITIONS, DEFAULT_EDITION = ("2026", "2025"), "2026"
INSTALLED = "installed.txt"  # what setup.sh installed (pip freeze), beside grading/ in the source folder

SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, as root, in /autograder/source when it builds the image (no GPU).
# It needs Python 3.11 or newer (an Ubuntu 24.04 base image) and PyTorch's CPU index.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="${AUTOGRADER_ROOT:-$(dirname "$HERE")}"
INDEX="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
fail() { echo "setup.sh: $*" >&2; exit 1; }
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \\
    || fail "the grader needs Python 3.11 or newer, python3 is $(python3 -V 2>&1): pick an Ubuntu 24.04 base image"
python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=60)' "$INDEX/torch/" 2>/dev/null \\
    || fail "PyTorch's CPU index $INDEX/torch/ cannot be reached (no network while the image builds?); set TORCH_INDEX_URL to a mirror"
if ! python3 -m venv "$ROOT/venv" 2>/dev/null; then
    { apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null && python3 -m venv "$ROOT/venv"; } \\
        || fail "could not make a virtual environment in $ROOT/venv (python3-venv missing and apt-get failed)"
fi
PY="$ROOT/venv/bin/python"
"$PY" -m pip install --quiet --upgrade pip || fail "pip could not upgrade itself from PyPI (no network?)"
# torch first, from the CPU index and without its dependencies: those are in requirements.txt at
# their locked versions, and a package there that requires torch then finds it installed.
"$PY" -m pip install --quiet --no-deps --index-url "$INDEX" "torch=={torch_version}" \\
    || fail "torch {torch_version} (the locked version) is not on $INDEX"
"$PY" -m pip install --quiet -r "$HERE/requirements.txt" || fail "the locked packages of requirements.txt did not install"
"$PY" -m pip freeze --all > "$HERE/{installed}"
"$PY" -c 'import sys, torch; v = torch.__version__; print("torch", v, "installed"); sys.exit(v.split("+")[0] != "{torch_version}")' \\
    || fail "torch {torch_version} was asked for, another version was installed"
"""

RUN = """#!/usr/bin/env bash
# Gradescope copies this file to /autograder/run_autograder and starts that copy from /autograder,
# one container per submission: the grader stays in /autograder/source, the student's files are in
# /autograder/submission, and Gradescope reads /autograder/results/results.json.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
if [ -d "$HERE/source/grading" ]; then ROOT="$HERE"; else ROOT="$(dirname "$HERE")"; fi  # or run as source/run_autograder
ROOT="${AUTOGRADER_ROOT:-$ROOT}"
PY="${GRADING_PYTHON:-$ROOT/venv/bin/python}"
[ -x "$PY" ] || { echo "run_autograder: $PY does not exist: setup.sh has not run in $ROOT/source" >&2; exit 1; }
mkdir -p "$ROOT/results"
cd "$ROOT/source"
export PYTHONPATH="$ROOT/source"
exec "$PY" -m grading "$ROOT/submission" --out "$ROOT/results" --repeats "${REPEATS:-{repeats}}" \\
    --time-limit "${TIME_LIMIT:-{time_limit}}" --edition "$(cat "$ROOT/source/grading/EDITION")"
"""


def requirements() -> tuple[list[str], str]:
    """The lock's packages for grading (not this project, no dev group), less torch and CUDA's;
    and the locked torch version."""
    uv = os.environ.get("UV") or shutil.which("uv")  # ``uv run`` names itself in UV
    command = [uv] if uv else [sys.executable, "-m", "uv"]
    exported = subprocess.run([*command, "export", "--locked", "--no-hashes", "--no-emit-project", "--no-dev",
                               "--format", "requirements-txt"], cwd=ROOT, capture_output=True, text=True)
    if exported.returncode:
        raise SystemExit(f"uv export failed (make autograder needs uv: run it without UV=0): {exported.stderr.strip()}")
    lines = [ln for ln in exported.stdout.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    torch = next(ln.split("==")[1].split(";")[0].strip() for ln in lines if ln.startswith("torch=="))
    return [ln for ln in lines if not ln.startswith(LEFT_OUT)], torch


def build(path: Path, edition: str = DEFAULT_EDITION) -> Path:
    """The package at ``path``, grading every submission as ``edition`` (the course's)."""
    if edition not in COURSE_EDITIONS:
        raise ValueError(f"the course's edition must be one of {COURSE_EDITIONS}, got {edition!r}")
    wanted, torch_version = requirements()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for file in sorted(GRADER_DIR.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts and file.suffix != ".pyc":
                z.write(file, Path("grading") / file.relative_to(GRADER_DIR))
        z.writestr("grading/COMMIT", grader_commit() + "\n")
        z.writestr("grading/EDITION", edition + "\n")
        z.writestr("requirements.txt", "\n".join(wanted) + "\n")
        setup = SETUP.replace("{torch_version}", torch_version).replace("{installed}", INSTALLED)
        run = RUN.replace("{repeats}", str(DEFAULT_REPEATS)).replace("{time_limit}", str(DEFAULT_TIME_LIMIT_S))
        for name, text in (("setup.sh", setup), ("run_autograder", run)):
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o100755 << 16  # executable, as Gradescope runs them
            z.writestr(info, text)
    return path


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[2:] and sys.argv[2] not in COURSE_EDITIONS:
        raise SystemExit(f"usage: python -m grading.course.autograder OUT.zip [{'|'.join(COURSE_EDITIONS)}]")
    course = sys.argv[2] if len(sys.argv) == 3 else DEFAULT_EDITION
    built = build(Path(sys.argv[1]), course)
    print(f"written: {built} ({built.stat().st_size // 1024} KiB), grading every submission as the {course} "
          "edition; upload it as the autograder of a programming assignment")
