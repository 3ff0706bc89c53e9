"""scripts/naive_ddp.py, the problem-2 deliverable: it passes, keeps its result, and refuses bad settings.

One spawned run (2 gloo ranks, 4 steps) must report a match and write a ``naive_ddp`` results
file; every other test stops before any rank starts.
"""

from __future__ import annotations

import pytest

import scripts.naive_ddp as naive_ddp
from cs336_systems.bench.equivalence import EquivalenceRecord, EquivalenceSetting
from cs336_systems.results.kinds import read_any

from .script_checks import interrupted_run_writes_nothing, must_not_start, refused_in_one_line

pytestmark = pytest.mark.problem("naive_ddp")


@pytest.mark.timeout(300)
def test_script_reports_a_match(capsys, tmp_path):
    out_file = tmp_path / "naive_ddp.json"
    assert naive_ddp.main(["--world-size", "2", "--steps", "4", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "MATCH" in out and "MISMATCH" not in out
    assert "ranks bitwise identical: True" in out
    results = read_any(out_file)
    (record,) = results.records
    assert record.match and record.world_size == 2 and len(record.max_abs_diff_per_step) == 4
    assert record.max_abs_diff == max(record.max_abs_diff_per_step) <= record.atol
    assert results.kind == "naive_ddp" and results.setting["global_batch"] == 32
    assert (results.environment.backend, results.environment.world_size) == ("gloo", 2)


def test_a_match_needs_the_tolerance_and_identical_ranks():
    def record(diff: float, identical: bool) -> EquivalenceRecord:
        return EquivalenceRecord("naive", 2, 1, 32, 0, 1e-5, [diff], diff, identical)
    assert record(1e-5, True).match
    assert not record(2e-5, True).match and not record(0.0, False).match


@pytest.fixture
def no_ranks(monkeypatch):
    must_not_start(monkeypatch, naive_ddp, "compare_with_single_process")


BAD_ARGS = [
    (["--steps", "0"], "--steps"),  # issue 14: an IndexError before
    (["--atol", "-1"], "--atol"),  # issue 14: ran and reported a mismatch before
    (["--world-size", "1"], "--world-size"),
    (["--global-batch", "0"], "--global-batch"),
    (["--variant", "per-parameter"], "--variant"),
    (["--seed", "-1"], "--seed"),
]


@pytest.mark.parametrize("args,flag", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_values_stop_before_any_rank_starts(args, flag, no_ranks, capsys):
    assert flag in refused_in_one_line(naive_ddp.main, args, capsys)


def test_script_refuses_a_batch_that_does_not_split(no_ranks, capsys):
    line = refused_in_one_line(naive_ddp.main, ["--world-size", "3", "--global-batch", "10"], capsys)
    assert "batch of 10 examples cannot be split evenly over world size 3" in line


def test_the_library_refuses_what_the_flags_refuse():
    for bad in (dict(steps=0), dict(atol=-1.0), dict(world_size=1), dict(variant="bucketed")):
        with pytest.raises(ValueError):
            EquivalenceSetting(**bad).validate()


def test_an_interrupted_run_writes_nothing(monkeypatch, tmp_path, capsys):
    interrupted_run_writes_nothing(monkeypatch, naive_ddp, "compare_with_single_process", tmp_path / "naive_ddp.json",
                                   capsys)
