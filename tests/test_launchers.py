"""Launching a script as ranks from outside: torchrun, and SLURM through submitit's local executor.

* submitit: ``scripts/submit_slurm.py --cluster local`` runs ``tests/allreduce_probe.py`` as 2
  CPU tasks; every rank's view of the job (rank, world size, local rank) and the all-reduced
  sum are checked against the closed form 1 + 2 + ... + n.
* torchrun: the real ``scripts/bench_allreduce.py`` runs as 2 ranks on a tiny payload; its
  results must come from a 2-rank group and pass the script's own check of the reduced values.

Ports come from the OS (conftest's MASTER_PORT, or a fresh free port for torchrun), never a
fixed number. Each launch costs ~10-20 s on a loaded 2-core machine (torch is imported by
every rank), so there is one launch per path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts_runner import run_script

from cs336_systems.launch import find_free_port
from cs336_systems.results.kinds import read_any
from cs336_systems.launch.slurm import (
    PORT_RANGE,
    SlurmJobSpec,
    master_port_for_job,
    rank_environment,
)

pytestmark = pytest.mark.problem("beyond")

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "allreduce_probe.py"
SUBMIT = REPO / "scripts" / "submit_slurm.py"
WORLD_SIZE = 2


def _check_probe_output(out_dir: Path, world_size: int) -> None:
    reports = sorted((json.loads(p.read_text()) for p in out_dir.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == list(range(world_size))
    expected_sum = world_size * (world_size + 1) / 2
    for r in reports:
        assert r["world_size"] == world_size
        assert r["local_rank"] == r["rank"]  # one node: local rank equals global rank
        assert r["backend"] == "gloo"
        assert r["reduced_sum"] == expected_sum


@pytest.mark.timeout(180)
def test_submit_slurm_local_executor_runs_script_as_ranks(tmp_path, monkeypatch, capsys):
    logs = tmp_path / "logs"
    status = run_script(
        monkeypatch, SUBMIT, "--cluster", "local", "--tasks-per-node", str(WORLD_SIZE),
        "--folder", str(logs), "--time-min", "3",
        # --world-size is ignored under a launcher: the job's task count decides.
        "--", str(PROBE), str(tmp_path / "out"), "--world-size", "99",
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert f"all {WORLD_SIZE} ranks exited 0" in out
    assert len(list(logs.glob("*_log.out"))) == WORLD_SIZE
    _check_probe_output(tmp_path / "out", WORLD_SIZE)


@pytest.mark.timeout(180)
def test_torchrun_runs_a_benchmark_script_as_ranks(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    out = tmp_path / "allreduce.json"
    command = [
        # torchrun's own module: the same launcher, found wherever this Python's packages are.
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD_SIZE), "--master-addr", "127.0.0.1",
        "--master-port", str(find_free_port()), str(REPO / "scripts" / "bench_allreduce.py"),
        "--device", "cpu", "--backend", "gloo",  # pinned: with a GPU the default would be NCCL
        "--sizes-mb", "0.01", "--warmup", "1", "--iters", "2", "--out", str(out),
    ]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    results = read_any(out)
    (record,) = results.records
    assert record.world_size == WORLD_SIZE and results.environment.world_size == WORLD_SIZE
    assert record.measured and record.correct is True


class _FakeJobEnvironment:
    """What submitit.JobEnvironment reports for task 5 of a 2-node x 4-task job."""

    job_id, global_rank, local_rank, num_tasks, num_nodes = "4242", 5, 1, 8, 2
    hostnames = ["node-a", "node-b"]


def test_rank_environment_from_job(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    env = rank_environment(_FakeJobEnvironment())
    assert env == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node-a", "MASTER_PORT": str(master_port_for_job("4242")),
    }
    monkeypatch.setenv("MASTER_PORT", "23456")
    assert rank_environment(_FakeJobEnvironment())["MASTER_PORT"] == "23456"


def test_master_port_is_deterministic_and_unprivileged():
    """Every task of a job computes the port in its own process: it must not depend on the
    per-process string-hash salt (PYTHONHASHSEED)."""
    ports = [master_port_for_job(str(job)) for job in range(1000, 1200)]
    code = (
        "from cs336_systems.launch.slurm import master_port_for_job as f; "
        "print([f(str(j)) for j in range(1000, 1200)])"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": "12345"},
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert json.loads(other.stdout) == ports
    assert all(PORT_RANGE[0] <= p < PORT_RANGE[1] for p in ports)
    assert len(set(ports)) > 150  # neighbouring job ids rarely share a port


def test_spec_rejects_what_the_executor_cannot_run():
    assert SlurmJobSpec(nodes=2, gpus_per_node=4).world_size == 8
    with pytest.raises(ValueError, match="runs on this machine only; got nodes=2"):
        SlurmJobSpec(nodes=2, cluster="local").validate()
    with pytest.raises(ValueError, match="tasks_per_node must be >= 1, got 0"):
        SlurmJobSpec(tasks_per_node=0).validate()


class _Setting:
    """A stand-in LaunchSetting: 3 ranks of gloo on the CPU, or one that its check refuses."""

    world_size, backend, device = 3, "gloo", "cpu"

    def __init__(self, refused: bool = False):
        self.refused = refused

    def validate(self) -> None:
        if self.refused:
            raise ValueError("--global-batch 5 does not split over 3 ranks")


def test_run_setting_checks_before_any_rank_starts_and_returns_rank_0s(monkeypatch):
    """A benchmark's run (launch.run_setting): a refused setting raises its ValueError with no rank
    started; an accepted one starts the setting's ranks with its backend, device and the two time
    limits, and returns rank 0's result."""
    from cs336_systems.launch import spawn

    calls = []

    def fake_run_ranks(fn, world_size, args=(), **kwargs):
        calls.append((fn, world_size, args, kwargs))
        return [f"rank {r}" for r in range(world_size)]

    monkeypatch.setattr(spawn, "run_ranks", fake_run_ranks)
    with pytest.raises(ValueError, match="does not split"):
        spawn.run_setting(print, _Setting(refused=True))
    assert calls == []
    setting = _Setting()
    assert spawn.run_setting(print, setting, 60, 120) == "rank 0"
    assert calls == [(print, 3, (setting,), {"backend": "gloo", "device_type": "cpu", "timeout_s": 60, "join_timeout_s": 120})]
