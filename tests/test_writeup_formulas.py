"""Section 8's answers state the formulas the code computes: each bound in the rendered README, read
back from its LaTeX, equals the function in ``cs336_systems/capacity/strategies.py`` that
tests/test_parallelism.py checks (against FLOP counts, real collectives and a simulated ring).

The templates write the LaTeX by hand; without this test a typo there ("2C" for "C") would pass.
The committed README is read (tests/test_writeup.py requires it to be what the results render).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from cs336_systems.capacity import strategies as st

from .test_writeup_ddp import answers

pytestmark = pytest.mark.problem("beyond")

README = Path(__file__).resolve().parents[1] / "writeup" / "README.md"
FRACTION = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
TOKEN = re.compile(r"\d+(?:\.\d+)?|[A-Za-z]|\*\*|[-+*/()]")


def python_of(tex: str) -> str:
    """The right-hand side of a bound as Python: fractions divided, D_FF named F, products made explicit,
    anything after ``\\approx`` (an approximation, not the bound) dropped."""
    s = tex.split(r"\approx")[0].strip().rstrip(".,")
    for old, new in ((r"D_{FF}", "F"), (r"\Big", ""), (r"\,", " "), ("^", "**")):
        s = s.replace(old, new)
    while FRACTION.search(s):
        s = FRACTION.sub(r"((\1)/(\2))", s)
    if leftover := re.sub(r"[\s\d.A-Za-z*/()+-]", "", s):
        raise ValueError(f"cannot read {tex!r}: {leftover!r} left")
    out: list[str] = []
    for token in TOKEN.findall(s):
        operand_before = out and (out[-1][-1].isalnum() or out[-1] == ")") and out[-1] != "**"
        if operand_before and (token[0].isalnum() or token == "("):
            out.append("*")
        out.append(token)
    return "".join(out)


def right_hand_sides(problem: str, lhs: str) -> list[str]:
    """Every ``lhs \\le ...`` or ``lhs = ...`` in the problem's rendered answer, as Python, in order."""
    text = answers(README.read_text())[problem]
    maths = re.findall(r"\$\$(.+?)\$\$|\$(.+?)\$", text, flags=re.S)
    found = [m.split(lhs, 1)[1] for pair in maths for m in pair if m and lhs in m]
    return [python_of(rhs) for rhs in found]


def points(count: int = 5):
    rng = random.Random(34)
    for _ in range(count):
        yield dict(B=rng.uniform(1e3, 1e6), F=rng.uniform(1e3, 1e5), D=rng.uniform(1e3, 1e4),
                   C=rng.uniform(1e14, 1e16), W=rng.uniform(1e10, 1e12), S=rng.uniform(1e6, 1e9), N=rng.randint(2, 64))


def ffn(v: dict) -> st.Ffn:
    return st.Ffn(batch=v["B"], d_model=v["D"], d_ff=v["F"])


CASES = [
    ("alternate_ring_all_reduce", r"T_{\text{alternate}} =", [lambda v: st.alternate_all_reduce_s(v["S"], v["N"], v["W"])]),
    ("data_parallel_calcs", r"N_{DP} \le", [lambda v: st.dp_max_devices(ffn(v), v["C"], v["W"])]),
    ("fsdp_calcs", r"N_{FSDP} \le", [lambda v: st.dp_max_devices(ffn(v), v["C"], v["W"])] * 2),
    ("tp_calcs", r"N_{TP} \le", [lambda v: st.tp_max_devices_backward(ffn(v), v["C"], v["W"]),
                                 lambda v: st.tp_max_devices_forward(ffn(v), v["C"], v["W"])]),
    ("fsdp_tp_calcs", "N \\le", [lambda v: st.fsdp_tp_max_devices_overlapped(ffn(v), v["C"], v["W"])[0],
                                 lambda v: st.fsdp_tp_max_devices_serial(ffn(v), v["C"], v["W"])[0]]),
]


@pytest.mark.parametrize("problem, lhs, functions", CASES, ids=[c[0] for c in CASES])
def test_each_rendered_bound_is_the_function_the_tests_check(problem, lhs, functions):
    expressions = right_hand_sides(problem, lhs)
    assert len(expressions) == len(functions), f"{problem}: found {expressions} for {lhs!r}"
    for expression, function in zip(expressions, functions):
        for v in points():
            assert eval(expression, {}, v) == pytest.approx(function(v), rel=1e-12), (problem, expression)


@pytest.mark.parametrize("tex, typo", [(r"1 + \dfrac{3D_{FF}W}{2C}", r"1 + \dfrac{3D_{FF}W}{C}"),
                                       (r"(N-1)\,\frac{S}{W}", r"N\,\frac{S}{W}")])
def test_a_typo_in_a_formula_changes_its_value(tex, typo):
    v = next(points())
    assert eval(python_of(tex), {}, v) != pytest.approx(eval(python_of(typo), {}, v), rel=1e-6)
