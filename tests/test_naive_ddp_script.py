"""scripts/naive_ddp.py: the problem-2 deliverable passes, and refuses an uneven batch."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.problem("naive_ddp")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "naive_ddp.py"


def _run_script(monkeypatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    return info.value.code


@pytest.mark.timeout(300)
def test_script_reports_a_match(monkeypatch, capsys, tmp_path):
    out_file = tmp_path / "naive_ddp.json"
    assert _run_script(monkeypatch, "--world-size", "2", "--steps", "4", "--out", str(out_file)) == 0
    out = capsys.readouterr().out
    assert "MATCH" in out and "MISMATCH" not in out
    assert "ranks bitwise identical: True" in out
    record = json.loads(out_file.read_text())["records"][0]
    assert record["match"] and record["world_size"] == 2 and len(record["max_abs_diff_per_step"]) == 4
    assert record["max_abs_diff"] <= record["atol"]


def test_script_refuses_a_batch_that_does_not_split(monkeypatch, capsys):
    assert _run_script(monkeypatch, "--world-size", "3", "--batch-size", "10") == 2
    assert "batch of 10 examples cannot be split evenly over world size 3" in capsys.readouterr().err
