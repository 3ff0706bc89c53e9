"""scripts/naive_ddp.py: the problem-2 deliverable passes, and refuses an uneven batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts_runner import run_script

pytestmark = pytest.mark.problem("naive_ddp")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "naive_ddp.py"



@pytest.mark.timeout(300)
def test_script_reports_a_match(monkeypatch, capsys, tmp_path):
    out_file = tmp_path / "naive_ddp.json"
    assert run_script(monkeypatch, SCRIPT, "--world-size", "2", "--steps", "4", "--out", str(out_file)) == 0
    out = capsys.readouterr().out
    assert "MATCH" in out and "MISMATCH" not in out
    assert "ranks bitwise identical: True" in out
    record = json.loads(out_file.read_text())["records"][0]
    assert record["match"] and record["world_size"] == 2 and len(record["max_abs_diff_per_step"]) == 4
    assert record["max_abs_diff"] <= record["atol"]


def test_script_refuses_a_batch_that_does_not_split(monkeypatch, capsys):
    assert run_script(monkeypatch, SCRIPT, "--world-size", "3", "--batch-size", "10") == 2
    assert "batch of 10 examples cannot be split evenly over world size 3" in capsys.readouterr().err
