"""scripts/check_env.py, behind ``make <target> UV=0``: names every missing package, exit 2."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytestmark = pytest.mark.problem("beyond")
CHECK = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "check_env.py"))


def test_this_environment_has_every_dependency(capsys):
    assert CHECK["main"]([]) == 0
    out = capsys.readouterr().out
    for name in CHECK["required_distributions"]():
        assert f"{name} " in out


def test_missing_packages_are_named_with_the_install_line(tmp_path, capsys):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "x"\ndependencies = ["torch>=2.6", "no-such-package-cs336>=1", "other_missing_cs336"]\n'
    )
    assert CHECK["required_distributions"](pyproject) == ["torch", "no-such-package-cs336", "other_missing_cs336"]
    assert CHECK["main"]([], pyproject) == 2
    err = capsys.readouterr().err
    assert "lacks 2 package(s)" in err and "no-such-package-cs336, other_missing_cs336" in err
    assert "pip install no-such-package-cs336 other_missing_cs336" in err
