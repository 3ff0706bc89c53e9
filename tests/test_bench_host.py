"""Issue 59: every run records what the host did (steal, a fixed calibration, the compute-only
step's spread); one that was not quiet is filed as such and never replaces a quieter run."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.setting import StepSetting
from cs336_systems.results import host as host_module
from cs336_systems.results.environment import Load
from cs336_systems.results.files import LoadedMachine, save_results
from cs336_systems.results.host import Host, HostWatch, cpu_times, spread
from cs336_systems.results.kinds import read_any
from cs336_systems.results.paths import NOT_QUIET_DIR, RESULTS_ROOT

from .test_writeup_allreduce import environment

pytestmark = pytest.mark.problem("beyond")
QUIET_HOST = Host(steal_s=0.1, steal_share=0.001, calibration_before_s=2.0e-3, calibration_after_s=2.05e-3,
                  compute_only_iqr=0.04, compute_only_max_min=1.1)


def _steps(times: list[float]) -> list[StepRecord]:
    compute = StepRecord.from_steps("compute-only", times, times, tokens_per_step=512)
    return [compute, StepRecord.from_steps("naive", [t + 0.1 for t in times], times, tokens_per_step=512)]


def test_proc_stat_steal_is_the_eighth_counter_of_the_cpu_line(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 50 800 10 1 2 30 7 0\ncpu0 50 2 25 400 5 0 1 15 3 0\nintr 1 2\n")
    # user nice system idle iowait irq softirq steal (guest is inside user): steal 30 of 998
    assert cpu_times(str(stat)) == (30, 998)
    assert cpu_times(str(tmp_path / "missing")) is None


def test_the_watch_records_steal_over_the_run_and_the_compute_only_spread(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 0 900 0 0 0 0 0 0\n")
    monkeypatch.setattr(host_module, "calibrate", lambda: 2.0e-3)
    watch = HostWatch(str(stat))
    stat.write_text("cpu  150 0 0 1000 0 0 0 50 0 0\n")  # 200 ticks more, 50 of them stolen
    times = [0.30, 0.31, 0.32, 0.33, 0.60]
    recorded = watch.record(_steps(times))
    assert recorded.steal_share == pytest.approx(0.25)
    assert recorded.steal_s == pytest.approx(50 / __import__("os").sysconf("SC_CLK_TCK"), abs=1e-3)
    # quartiles of 0.30..0.60 (inclusive method): 0.31 and 0.33; max/min 2
    assert (recorded.compute_only_iqr, recorded.compute_only_max_min) == (pytest.approx(0.02 / 0.32, abs=1e-4), 2.0)
    verdict = recorded.verdict()
    assert verdict.quiet is False and any("stole 25.0%" in r for r in verdict.reasons)
    assert watch.record([]).compute_only_iqr is None  # a run with no compute-only step


def test_the_quiet_limits_are_the_issues():
    assert QUIET_HOST.verdict().quiet is True and QUIET_HOST.verdict().reasons == []
    wide = dataclasses.replace(QUIET_HOST, compute_only_iqr=0.145, compute_only_max_min=1.58)
    assert wide.verdict().quiet is False and "interquartile range is 0.145" in wide.verdict().reasons[0]
    assert dataclasses.replace(QUIET_HOST, compute_only_iqr=0.10).verdict().quiet  # at most 0.10
    drifted = dataclasses.replace(QUIET_HOST, calibration_after_s=2.5e-3).verdict()
    assert not drifted.quiet and "+25% at the end" in drifted.reasons[0]
    assert not QUIET_HOST.verdict("other jobs kept 0.60").quiet
    assert spread([1.0, 1.0, 1.0]) is None and spread([1.0] * 4) == (0.0, 1.0)


def _save(path, host, times=(0.30, 0.31, 0.32, 0.33)):
    env = dataclasses.replace(environment(), host=host)
    return save_results(path, StepRecord.KIND, StepSetting(), _steps(list(times)), env)


@pytest.fixture
def committed_folder(request):
    """A machine folder among the committed results (where the rules hold), one per test, removed after."""
    folder = RESULTS_ROOT / f"cpu2-test-host-{request.node.name.removeprefix('test_')[:40]}"
    yield folder
    for path in sorted(folder.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    folder.rmdir() if folder.exists() else None


def test_a_run_that_was_not_quiet_never_replaces_a_quieter_one(committed_folder):
    path = committed_folder / "ddp_step.json"
    assert _save(path, QUIET_HOST) == path and read_any(path).environment.host.quiet is True
    noisy = dataclasses.replace(QUIET_HOST, compute_only_iqr=0.2, compute_only_max_min=1.8)
    apart = _save(path, noisy)
    assert apart == committed_folder / NOT_QUIET_DIR / "ddp_step.json"
    assert read_any(path).environment.host.quiet is True  # the quiet run stays in place
    filed = json.loads(apart.read_text())["environment"]["host"]
    assert filed["quiet"] is False and "interquartile range is 0.200" in filed["reasons"][0]


def test_a_not_quiet_run_replaces_one_no_quieter_and_is_marked(committed_folder):
    path = committed_folder / "ddp_step.json"
    wide = dataclasses.replace(QUIET_HOST, compute_only_iqr=0.3, compute_only_max_min=2.0)
    narrower = dataclasses.replace(QUIET_HOST, compute_only_iqr=0.2, compute_only_max_min=1.5)
    assert _save(path, wide) == path
    assert _save(path, narrower) == path  # not quiet either, but the narrower spread: it replaces
    assert read_any(path).environment.host.compute_only_iqr == 0.2
    assert _save(path, wide) != path  # and a wider one after it does not


def test_the_profile_is_refused_from_a_quarter_core_of_other_jobs(committed_folder):
    """The profile backs single events (overlap, the model's B): other jobs at 0.25 refuse it."""
    from cs336_systems.bench.profile.record import ProfileRecord
    from cs336_systems.bench.profile.setting import ProfileSetting

    env = dataclasses.replace(environment(), load=Load(before=0.2, after=1.5, cores=2, processes=2, others=0.25))
    with pytest.raises(LoadedMachine, match="not below the limit 0.25"):
        save_results(committed_folder / "profile" / "profile.json", ProfileRecord.KIND, ProfileSetting(),
                     [object.__new__(ProfileRecord)], env)
    assert not Load(before=0.2, after=1.5, cores=2, processes=2, others=0.25).exceeded  # other kinds: 0.5


def test_the_setting_line_says_what_the_host_did_and_why_a_run_was_not_quiet():
    from cs336_systems.writeup import fmt

    quiet = dataclasses.replace(environment(), host=QUIET_HOST.verdict())
    line = fmt.setting_line(quiet, "x/ddp_step.json")
    assert "steal 0.10%, calibration 2.00 → 2.05 ms, compute-only step spread 0.040 of its median (max/min 1.10)" in line
    assert "not quiet" not in line
    noisy = dataclasses.replace(environment(), host=dataclasses.replace(QUIET_HOST, compute_only_iqr=0.25).verdict())
    assert "not quiet (the compute-only step's interquartile range is 0.250 of its median" in fmt.setting_line(
        noisy, "x/ddp_step.json")
