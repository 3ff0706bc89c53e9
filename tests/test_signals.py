"""A stopped job leaves no rank behind: SIGTERM or SIGINT to a launcher ends every process of it.

What stops batch jobs is SIGTERM (``kill``, ``scancel``, a time limit), sent to a launcher
that a shell script started in the background, where SIGINT is ignored; Ctrl-C in a terminal
sends SIGINT to every process of the foreground group. In both cases every rank must be gone
within 10 s, the launcher must end with one line, ``interrupted: ...``, and the shell's status
for the signal, nobody may print a traceback, and no results file may be written. Processes of
a job are found by a marker in their environment, which ranks inherit and keep even when they
are reparented to init. torchrun forwards signals to its workers; that path is checked too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cs336_systems.launch import find_free_port

pytestmark = [pytest.mark.problem("beyond"), pytest.mark.timeout(180)]
REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "signal_probe.py"
MARKER = "CS336_SIGNAL_TEST"
GONE_WITHIN_S = 10.0


def _processes_with(token: str) -> list[int]:
    """Live processes whose environment holds ``MARKER=token`` (zombies have no environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"{MARKER}={token}".encode() in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def _start(command: list[str], tmp_path: Path, token: str, **popen) -> subprocess.Popen:
    env = {**os.environ, MARKER: token}
    env.pop("MASTER_PORT", None)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def _check_stopped(process: subprocess.Popen, token: str, out: Path, status: int) -> str:
    assert _wait_for(lambda: not _processes_with(token), GONE_WITHIN_S), (
        f"processes left {GONE_WITHIN_S:g} s after the signal: {_processes_with(token)}"
    )
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == status, stderr
    assert not out.exists(), "a results file was written for an interrupted run"
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    return stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_a_background_launcher_stops_every_rank(tmp_path):
    ready, out, pid_file = tmp_path / "ready", tmp_path / "out", tmp_path / "pid"
    token = uuid.uuid4().hex
    # As a batch script starts things: in the background of a non-interactive shell, which
    # makes the job ignore SIGINT, so only the launcher's own handling can stop its ranks.
    script = f'"{sys.executable}" "{PROBE}" --ready "{ready}" --out "{out}" & echo $! > "{pid_file}"; wait $!'
    shell = _start(["sh", "-c", script], tmp_path, token)
    assert _wait_for(ready.exists, 90), shell.stderr.read() if shell.poll() is not None else "no ranks"
    launcher = int(pid_file.read_text())
    assert len(_processes_with(token)) >= 3  # the shell's job: launcher and two ranks
    os.kill(launcher, signal.SIGTERM)
    stderr = _check_stopped(shell, token, out, 128 + signal.SIGTERM)
    assert stderr.strip().splitlines() == [stderr.strip()] and stderr.startswith("interrupted: received SIGTERM")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_stops_every_rank_without_tracebacks(tmp_path):
    ready, out = tmp_path / "ready", tmp_path / "out"
    token = uuid.uuid4().hex
    launcher = _start([sys.executable, str(PROBE), "--ready", str(ready), "--out", str(out)], tmp_path, token, start_new_session=True)
    assert _wait_for(ready.exists, 90), "no ranks"
    os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
    stderr = _check_stopped(launcher, token, out, 128 + signal.SIGINT)
    assert stderr.strip().splitlines() == [stderr.strip()] and stderr.startswith("interrupted: received SIGINT")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_to_the_launcher_takes_its_ranks_down(tmp_path):
    """A launcher killed outright (no handler runs) still leaves no rank: they die with it."""
    ready, out = tmp_path / "ready", tmp_path / "out"
    token = uuid.uuid4().hex
    launcher = _start([sys.executable, str(PROBE), "--ready", str(ready), "--out", str(out)], tmp_path, token)
    assert _wait_for(ready.exists, 90), "no ranks"
    launcher.kill()
    assert _wait_for(lambda: not _processes_with(token), GONE_WITHIN_S), _processes_with(token)
    launcher.communicate(timeout=30)
    assert not out.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_torchrun_stops_its_ranks(tmp_path):
    ready, out = tmp_path / "ready", tmp_path / "out"
    token = uuid.uuid4().hex
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(find_free_port()), str(PROBE), "--ready", str(ready), "--out", str(out)]
    torchrun = _start(command, tmp_path, token)
    assert _wait_for(ready.exists, 90), "no ranks"
    torchrun.send_signal(signal.SIGTERM)
    assert _wait_for(lambda: not _processes_with(token), GONE_WITHIN_S), _processes_with(token)
    torchrun.communicate(timeout=30)
    assert torchrun.returncode != 0 and not out.exists()


RUN_A_SUITE = """
import runpy, sys
from cs336_systems.bench import suites
from cs336_systems.bench.suites import BenchStep
probe = {probe!r}
suites.quick_suite = lambda out: [
    BenchStep("short step", probe, ("--ready", {ready1!r}, "--seconds", "0.5"), {out1!r}),
    BenchStep("long step", probe, ("--ready", {ready2!r}), {out2!r}),
]
sys.argv = ["run_benchmarks.py", "--suite", "quick"]
runpy.run_path("scripts/run_benchmarks.py", run_name="__main__")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_interrupted_suite_keeps_finished_parts_and_names_the_missing(tmp_path):
    files = {name: str(tmp_path / name) for name in ("ready1", "ready2", "out1", "out2")}
    token = uuid.uuid4().hex
    runner = _start([sys.executable, "-c", RUN_A_SUITE.format(probe=str(PROBE), **files)], tmp_path, token)
    _wait_for(lambda: Path(files["ready2"]).exists() or runner.poll() is not None, 120)
    if not Path(files["ready2"]).exists():
        runner.kill()
        stdout, stderr = runner.communicate(timeout=30)
        pytest.fail(f"the second step never started; the runner printed:\n{stdout}\n{stderr}")
    runner.send_signal(signal.SIGTERM)
    stderr = _check_stopped(runner, token, Path(files["out2"]), 128 + signal.SIGTERM)
    assert Path(files["out1"]).is_file()  # the finished step's results stay
    assert "interrupted: received SIGTERM, during step 'long step'" in stderr
    assert "missing: long step; `make bench-quick` reruns the suite" in stderr
