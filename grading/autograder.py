"""``make autograder``: ``autograder.zip``, ready to upload to Gradescope.

Gradescope unpacks the zip into ``/autograder/source``, runs ``setup.sh`` once when it builds
the image, then ``run_autograder`` for each submission, with the student's files in
``/autograder/submission``; it reads ``/autograder/results/results.json``
(https://gradescope-autograders.readthedocs.io/en/latest/specs/). The zip holds:

* ``grading/``: this grader, with ``COMMIT`` (the commit it was built from: grade.md names it);
* ``requirements.txt``: every package of this repository's lock that grading needs, as locked,
  but torch and the CUDA libraries (Gradescope's machines have no GPU);
* ``setup.sh``: a virtual environment in ``$AUTOGRADER_ROOT/venv`` with torch's CPU build (from
  PyTorch's CPU index, the newest no later than the locked version) and ``requirements.txt``;
* ``run_autograder``: grades ``$AUTOGRADER_ROOT/submission`` into ``$AUTOGRADER_ROOT/results``.
  ``AUTOGRADER_ROOT`` (default ``/autograder``) lets a test run it in a scratch tree, and
  ``GRADING_PYTHON`` names an interpreter that has the packages already.

    python -m grading.autograder autograder.zip
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

SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the image (no GPU). Python 3.11 or newer.
set -euo pipefail
ROOT="${AUTOGRADER_ROOT:-/autograder}"
cd "$(dirname "$0")"
python3 -c 'import sys; assert sys.version_info >= (3, 11), "the grader needs Python 3.11+: pick an Ubuntu 24.04 base image"'
if ! python3 -m venv "$ROOT/venv"; then
    apt-get update && apt-get install -y python3-venv && python3 -m venv "$ROOT/venv"
fi
"$ROOT/venv/bin/python" -m pip install --quiet --upgrade pip
"$ROOT/venv/bin/python" -m pip install --quiet --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" \\
    "torch<={torch_version}"
"$ROOT/venv/bin/python" -m pip install --quiet -r requirements.txt
"$ROOT/venv/bin/python" -c 'import torch; print("torch", torch.__version__, "installed")'
"""

RUN = """#!/usr/bin/env bash
# Gradescope's entry point: one container per submission.
set -euo pipefail
ROOT="${AUTOGRADER_ROOT:-/autograder}"
cd "$(dirname "$0")"
mkdir -p "$ROOT/results"
exec "${GRADING_PYTHON:-$ROOT/venv/bin/python}" -m grading "$ROOT/submission" --out "$ROOT/results" \\
    --repeats "${REPEATS:-3}"
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


def build(path: Path) -> Path:
    wanted, torch_version = requirements()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for file in sorted(GRADER_DIR.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts and file.suffix != ".pyc":
                z.write(file, Path("grading") / file.relative_to(GRADER_DIR))
        z.writestr("grading/COMMIT", grader_commit() + "\n")
        z.writestr("requirements.txt", "\n".join(wanted) + "\n")
        for name, text in (("setup.sh", SETUP.replace("{torch_version}", torch_version)), ("run_autograder", RUN)):
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o100755 << 16  # executable, as Gradescope runs them
            z.writestr(info, text)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m grading.autograder OUT.zip")
    built = build(Path(sys.argv[1]))
    print(f"written: {built} ({built.stat().st_size // 1024} KiB); upload it as the autograder of a programming assignment")
