"""Results taken on a loaded machine: recorded, refused a place among the results, marked on the pages.

Every results file records the machine's load (results.environment.Load). ``save_results``
refuses to write a run into the committed results folder when the load exceeded what the run's
own processes account for, with one line naming the load; into any other folder (a test's) it
writes the run with its load. The setting line of every page says the load, and that a loaded
run's timings are not evidence.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest

from cs336_systems.bench.claims import ClaimsRecord, ClaimsSetting
from cs336_systems.results import others
from cs336_systems.results.environment import REPO_ROOT, Load, measure_load
from cs336_systems.results.files import LoadedMachine, save_results
from cs336_systems.results.kinds import read_any
from cs336_systems.results.paths import RESULTS_ROOT
from cs336_systems.writeup import fmt

from .test_writeup_allreduce import environment

pytestmark = pytest.mark.problem("beyond")

LOADED = Load(before=19.8, after=20.4, cores=2, processes=2)
QUIET = Load(before=0.3, after=2.0, cores=2, processes=2)


def _record() -> ClaimsRecord:
    return ClaimsRecord("torch", "lightning-ddp", {}, "32-true", [0.2, 0.2], 1, None)


def test_load_exceeds_only_beyond_the_runs_own_processes():
    assert LOADED.exceeded and not QUIET.exceeded
    assert not Load(before=0.1, after=5.9, cores=2, processes=6).exceeded  # a 6-rank grid on 2 cores
    assert Load(before=3.1, after=0.5, cores=2, processes=2).exceeded  # others ran before it started
    assert measure_load(2).cores >= 1 and measure_load(2).processes == 2


def test_other_jobs_decide_where_they_were_counted():
    """Two ranks' own threads read 2.3 on 2 cores with nothing else running: not busy when other
    jobs' threads were counted low; busy when they were high, or when the load before the start
    (none of the run's threads yet) was over the cores."""
    assert not Load(before=0.4, after=2.3, cores=2, processes=2, others=0.05).exceeded
    assert Load(before=0.4, after=2.3, cores=2, processes=2).exceeded  # not counted: the load average decides
    busy = Load(before=0.4, after=2.3, cores=2, processes=2, others=1.2)
    assert busy.exceeded and "other jobs' threads at 1.20, not below the limit 0.5" in busy.why_busy()
    assert Load(before=3.1, after=2.3, cores=2, processes=2, others=0.0).exceeded


def test_a_busy_process_outside_the_run_is_counted_and_one_inside_is_not():
    """A busy loop started by this process is its own (a rank); the same loop seen from a
    sibling's tree (a sleeping process standing in for another script) is another job's."""
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for _ in range(100):
            parents, busy = others.runnable_threads()
            if busy.get(loop.pid):
                break
            time.sleep(0.02)
        assert busy.get(loop.pid, 0) >= 1
        assert others.descends(loop.pid, os.getpid(), parents) and not others.descends(loop.pid, sibling.pid, parents)
        sampler = others.OthersSampler(root=sibling.pid, interval_s=0.02)
        sampler.start()
        deadline = time.monotonic() + 30  # ten readings, however long a loaded machine takes to make them
        while len(sampler.counts) < 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        sampler.stop()
        sampler.join()  # no thread left in this test process when later tests fork
        assert sampler.mean() is not None and sampler.mean() >= 0.5  # the loop, runnable all along
    finally:
        loop.kill(), sibling.kill()
        loop.wait(), sibling.wait()


def test_a_loaded_run_is_refused_among_the_results_and_written_elsewhere(tmp_path):
    env = dataclasses.replace(environment(), load=LOADED)
    committed = RESULTS_ROOT / "cpu2-test-loaded" / "lightning_claims.json"
    with pytest.raises(LoadedMachine, match=r"load average 19\.8 before and 20\.4 after, on 2 cores"):
        save_results(committed, ClaimsRecord.KIND, ClaimsSetting(), [_record()], env)
    assert not committed.exists() and not committed.parent.exists()
    elsewhere = save_results(tmp_path / "lightning_claims.json", ClaimsRecord.KIND, ClaimsSetting(), [_record()], env)
    assert read_any(elsewhere).environment.load == LOADED  # recorded, and read back as a Load


def test_the_setting_line_says_the_load_and_whether_timings_are_evidence():
    assert "load 0.3 before, 2.0 after on 2 cores, other jobs not counted ·" in fmt.setting_line(
        dataclasses.replace(environment(), load=QUIET), "x/y.json")
    counted = dataclasses.replace(QUIET, others=0.04)
    assert "load 0.3 before, 2.0 after on 2 cores, other jobs 0.04 runnable ·" in fmt.setting_line(
        dataclasses.replace(environment(), load=counted), "x/y.json")
    assert "over its 2: timings not evidence" in fmt.setting_line(
        dataclasses.replace(environment(), load=LOADED), "x/y.json")
    assert "load not recorded: timings not evidence" in fmt.setting_line(
        dataclasses.replace(environment(), load=None), "x/y.json")


def test_a_refused_script_ends_with_one_line_and_status_3(tmp_path, monkeypatch):
    """The CLI dialect: a script whose save is refused prints one line (no traceback)."""
    code = ("import sys; from cs336_systems import cli; from cs336_systems.results.files import LoadedMachine\n"
            "@cli.stops_cleanly\ndef main(argv=None):\n    raise LoadedMachine('not written to x: load')\n"
            "sys.exit(main())")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert done.stderr.strip().splitlines() == ["refused: not written to x: load"]
