"""Running the course's public test files, unchanged, on either implementation (CS336_IMPL).

The public files are the course's, so this repository does not carry them. They are found in a
checkout of the course's repository named by an environment variable (its ``tests/`` folder):

    CS336_PUBLIC_TESTS_2025=<stanford-cs336/assignment2-systems at e495ed7>
    CS336_PUBLIC_TESTS_2026=<the 2026 handout repository at 26.1.4>

or, for the edition they belong to, in this repository's ``tests/`` where the README says they can
be dropped. ``run_public_suite`` copies them into a scratch ``tests`` package beside this
repository's ``tests/adapters.py`` and ``tests/common.py`` (what the public files import) and a
conftest that gives every test a free rendezvous port, and runs pytest there in a subprocess with
``CS336_IMPL`` set.

    .venv/bin/python -m tests.public_suite 2026 answers --runs 5 -n 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PUBLIC_FILES = {
    "2025": ("test_ddp.py", "test_ddp_individual_parameters.py", "test_sharded_optimizer.py"),
    "2026": ("test_ddp.py", "test_fsdp.py", "test_sharded_optimizer.py"),
}
MARKER = {"2025": "test_ddp_individual_parameters.py", "2026": "test_fsdp.py"}  # a file only that edition has
CONFTEST = '''"""A free rendezvous port and loopback gloo for every public test (as the repository's conftest)."""
import pytest
from cs336_systems.launch import find_free_port


@pytest.fixture(autouse=True)
def free_rendezvous_port(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
'''


def public_tests_folder(edition: str) -> Path | None:
    """Where this edition's public test files are, or None (see the module docstring)."""
    named = os.environ.get(f"CS336_PUBLIC_TESTS_{edition}")
    if named:
        folder = Path(named) / "tests" if (Path(named) / "tests").is_dir() else Path(named)
        missing = [f for f in PUBLIC_FILES[edition] if not (folder / f).is_file()]
        if missing:
            raise FileNotFoundError(f"CS336_PUBLIC_TESTS_{edition}={named}: {folder} lacks {missing}")
        return folder
    dropped = REPO / "tests"
    if all((dropped / f).is_file() for f in PUBLIC_FILES[edition]) and (dropped / MARKER[edition]).is_file():
        return dropped
    return None


def scratch_package(edition: str, folder: Path, dest: Path) -> Path:
    """A ``tests`` package holding the public files and what they import; returns its root."""
    package = dest / "tests"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name in PUBLIC_FILES[edition]:
        shutil.copy(folder / name, package / name)
    for name in ("adapters.py", "common.py"):
        shutil.copy(REPO / "tests" / name, package / name)
    (package / "conftest.py").write_text(CONFTEST)
    (package / "fixtures").symlink_to(REPO / "tests" / "fixtures")  # the DDP tests' data
    return dest


def run_public_suite(edition: str, impl: str, folder: Path, extra: list[str] = (), timeout_s: float = 600
                     ) -> subprocess.CompletedProcess:
    """pytest over the edition's public files with CS336_IMPL=impl, in a scratch copy."""
    with tempfile.TemporaryDirectory(prefix=f"public{edition}-") as scratch:
        root = scratch_package(edition, folder, Path(scratch))
        env = {**os.environ, "CS336_IMPL": impl, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", *extra]
        return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)


def main() -> int:
    parser = argparse.ArgumentParser(description="run an edition's public test files on one implementation")
    parser.add_argument("edition", choices=sorted(PUBLIC_FILES))
    parser.add_argument("impl", choices=("library", "answers"))
    parser.add_argument("--runs", type=int, default=1, help="whole runs of the files, one after another")
    parser.add_argument("-n", default="0", help="pytest-xdist workers per run")
    args = parser.parse_args()
    folder = public_tests_folder(args.edition)
    if folder is None:
        parser.error(f"no public {args.edition} test files: set CS336_PUBLIC_TESTS_{args.edition}")
    failed = 0
    for run in range(1, args.runs + 1):
        done = run_public_suite(args.edition, args.impl, folder, ["-n", args.n])
        print(f"run {run}: exit {done.returncode}: {done.stdout.strip().splitlines()[-1]}", flush=True)
        if done.returncode:
            failed += 1
            print(done.stdout[-4000:], done.stderr[-2000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
