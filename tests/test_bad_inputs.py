"""Every flag of every script refuses bad values where it is parsed: exit 2, one line, no traceback.

Generated from the scripts themselves: each script's ``build_parser()`` lists its flags, and
each flag's check (cs336_systems/cli.py) knows values it must refuse (zero or negative counts,
non-numbers, NaN, absurdly large sizes, fractions above 1, unknown choices, paths that cannot be
written or do not exist). A flag added tomorrow is covered the moment it exists, and a flag
without a check fails :func:`test_every_flag_is_checked`. Nothing here starts a rank: a refused
value must stop the script before any process starts.
"""

from __future__ import annotations

import argparse
import runpy
from pathlib import Path

import pytest

from cs336_systems import cli

pytestmark = pytest.mark.problem("beyond")
SCRIPTS = sorted(p for p in (Path(__file__).resolve().parents[1] / "scripts").glob("*.py") if p.name != "__init__.py")
# Arguments a script cannot run without, given after the flag under test.
REQUIRED = {"submit_slurm.py": ["--", "tests/allreduce_probe.py"]}


def _namespace(script: Path) -> dict:
    return runpy.run_path(str(script), run_name="script_under_test")


def _checked_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if isinstance(a.type, cli.Check) and a.option_strings]


def _cases() -> list[tuple[str, str, str]]:
    cases = []
    for script in SCRIPTS:
        parser = _namespace(script)["build_parser"]()
        for action in _checked_actions(parser):
            cases += [(script.name, action.option_strings[0], bad) for bad in action.type.bad_values]
    return cases


CASES = _cases()


@pytest.mark.parametrize("script", [s.name for s in SCRIPTS])
def test_every_flag_is_checked(script):
    parser = _namespace(Path(SCRIPTS[0].parent / script))["build_parser"]()
    unchecked = [
        a.option_strings or [a.dest] for a in parser._actions
        if not isinstance(a, argparse._HelpAction) and a.nargs != 0 and not isinstance(a.type, cli.Check)
        and a.nargs != argparse.REMAINDER
    ]
    assert unchecked == [], f"{script}: flags without a cli.Check: {unchecked}"


@pytest.mark.parametrize("script,flag,bad", CASES, ids=[f"{s}-{f}={b!r}" for s, f, b in CASES])
def test_a_bad_value_is_refused_in_one_line(script, flag, bad, capsys):
    main = _namespace(SCRIPTS[0].parent / script)["main"]
    with pytest.raises(SystemExit) as exit_info:
        main([flag, bad, *REQUIRED.get(script, [])])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "error" in lines[0], captured.err
    assert "Traceback" not in captured.err + captured.out


def test_the_cases_cover_every_script_with_flags():
    """At least the scripts that take settings contribute cases (a broken discovery would pass vacuously)."""
    covered = {script for script, _, _ in CASES}
    assert {"bench_allreduce.py", "bench_ddp.py", "naive_ddp.py", "profile_ddp.py", "doctor.py",
            "bench_sharded_optimizer.py", "make_writeup.py", "run_benchmarks.py"} <= covered
    assert len(CASES) > 100
