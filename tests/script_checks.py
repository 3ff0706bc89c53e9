"""Checks every script of the DDP benchmarks must pass: bad values refused in one line, interruptions clean.

Used by the tests of scripts/bench_ddp.py, scripts/profile_ddp.py and scripts/naive_ddp.py, which
replace the function that would start ranks, so that a check that fails starts nothing.
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest

from cs336_systems.launch import Interrupted


def refused_in_one_line(main: Callable[[list[str]], int], args: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run ``main(args)``; it must exit with status 2 and one ``error`` line, no traceback. Returns the line."""
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert info.value.code == 2 and len(lines) == 1, err
    assert "error" in lines[0] and "Traceback" not in err
    return lines[0]


def must_not_start(monkeypatch: pytest.MonkeyPatch, script: ModuleType, runner: str) -> None:
    """Make ``script.runner`` fail the test if the script calls it."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"{script.__name__} started its run with {args}")
    monkeypatch.setattr(script, runner, refuse)


def interrupted_run_writes_nothing(monkeypatch: pytest.MonkeyPatch, script: ModuleType, runner: str, out: Path,
                                   capsys: pytest.CaptureFixture, signum: int = signal.SIGTERM) -> None:
    """``script.main`` whose run is stopped by ``signum`` returns 128 + signum, says so in one line, and
    leaves ``out``'s folder empty."""
    def interrupted(*args, **kwargs):
        raise Interrupted(signum, "stopped 2 of 2 ranks")
    monkeypatch.setattr(script, runner, interrupted)
    assert script.main(["--out", str(out)]) == 128 + signum
    name = signal.Signals(signum).name
    assert capsys.readouterr().err.strip() == f"interrupted: received {name}; stopped 2 of 2 ranks"
    assert list(out.parent.iterdir()) == []
