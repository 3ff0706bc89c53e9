"""Run one of our scripts in this process, as ``python scripts/<name>.py ...`` would."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def run_script(monkeypatch: pytest.MonkeyPatch, script: str | Path, *args: str) -> int:
    """The script's exit status; ``script`` is a path or a name under scripts/."""
    path = Path(script) if Path(script).is_absolute() else SCRIPTS / script
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(path), run_name="__main__")
    return info.value.code
