"""What staff read: a result off by a constant factor says so; a test whose adapter is the stub runs once.

* compare() on a rank whose step moved every weight twice as far as the reference's (gradients
  summed over 2 ranks) or two thirds as far (a divisor of 3 on top of an average over 2): the
  finding names the factor and its likely cause; a difference that is no factor names none; a
  weight the step never moved says so, not "a wrong count".
* The plugin, with --grading-repeats 3, runs a test that fails with the stub's
  NotImplementedError once and skips its other repetitions; a test that fails otherwise runs
  every time.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from grading.suite.checks import compare

pytestmark = pytest.mark.problem("beyond")

DISAGREE = ("weights differ at construction", "gradients differ")


def _reports(factor: float, noise: float = 0.0) -> tuple[list[dict], list[dict]]:
    g = torch.Generator().manual_seed(0)
    before, step = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g) * 0.1
    expected = [{"w": before}, {"w": before + step}]
    got = before + factor * step + noise * torch.randn(4, 5, generator=g)
    return [{"params": [{"w": before.clone()}, {"w": got}]}] * 2, expected


@pytest.mark.parametrize("factor", [2.0, 2 / 3])
def test_a_constant_factor_is_named(factor):
    reports, expected = _reports(factor)
    found = compare(reports, expected, ["after construction", "after step 1 of 1"], DISAGREE)
    assert found.startswith("rank 0: parameter w after step 1 of 1 differs from single-process training"), found
    assert f"the step moved it {factor:.3g} times as far as single-process training" in found
    assert "the average's divisor?" in found


def test_a_parameter_the_step_left_alone_is_named_so():
    """A factor of 0 is no wrong divisor: a parameter the optimizer never stepped reads as such."""
    reports, expected = _reports(0.0)
    found = compare(reports, expected, ["after construction", "after step 1 of 1"], DISAGREE)
    assert "the step did not move it at all" in found and "divisor" not in found, found


def test_a_difference_that_is_no_factor_names_none():
    reports, expected = _reports(1.0, noise=0.05)
    found = compare(reports, expected, ["after construction", "after step 1 of 1"], DISAGREE)
    assert found and "times as far" not in found


def test_a_stub_adapter_runs_once(tmp_path):
    (tmp_path / "test_stub.py").write_text(textwrap.dedent('''
        import pytest

        def test_stub():
            pytest.fail("rank 0: tests/adapters.py:3: NotImplementedError (adapter not implemented)", pytrace=False)

        def test_wrong():
            pytest.fail("rank 0: parameter w differs", pytrace=False)
        '''))
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "grading.reports.plugin", "-p", "no:cacheprovider",
                          "--grading-repeats", "3", "-q", "-rs", "-c", "/dev/null", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert "4 failed, 2 skipped" in out.stdout, out.stdout[-2000:]
    assert "not run again: an adapter it needs is not implemented" in out.stdout
