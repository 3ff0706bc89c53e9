"""Every piece of mathematics in Section 8's answers is accounted for: each formula, the
intermediate ones too (FLOPs per device, bytes per step, the times and the steps of each
derivation), is read back from the rendered README and evaluated against the functions of
``cs336_systems/capacity/strategies.py`` that tests/test_parallelism.py checks; everything else
is a declared name or shape (``x^{(j)}``, ``[B, D]``, ``dW_3``).

A fragment of an answer that is neither is an error, so a changed constant ("13" for "12" in
data_parallel_calcs (a)) fails twice: its LaTeX is no longer the registered one, and its value
is not the function's. tests/test_writeup_formulas.py reads the final bounds the same way.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Callable

import pytest

from cs336_systems.capacity import strategies as st

from .test_writeup_ddp import answers
from .test_writeup_formulas import FRACTION

pytestmark = pytest.mark.problem("beyond")

README = Path(__file__).resolve().parents[1] / "writeup" / "README.md"
# Single letters for the answers' subscripted symbols: the device counts of each axis, D_FF, max().
SYMBOLS = ((r"N_{DP}", "N"), (r"N_{FSDP}", "P"), (r"N_{TP}", "Q"), (r"D_{FF}", "F"), (r"\max", "M"),
           (r"\left(", "("), (r"\right)", ")"), (r"\Big", ""), (r"\cdot", "*"), (r"\,", " "), (r"\ ", " "), ("^", "**"))
TOKEN = re.compile(r"\d+(?:\.\d+)?|[A-Za-z]|\*\*|[-+*/(),]")
RELATION = re.compile(r"\\le(?![a-z])|\\ge(?![a-z])|:=|=|\\approx")
NAME = None  # a symbol, a shape or an equation between tensors: nothing to evaluate
SKIP = None  # a side of a relation that names what is bounded (N, T_{comm}, N_{FSDP} - 1)
Side = Callable[[dict], float] | None


def python_of(tex: str) -> str:
    """One side of a relation as Python over single-letter variables (M is max)."""
    s = tex.strip().rstrip(".,").strip()
    for old, new in SYMBOLS:
        s = s.replace(old, new)
    while FRACTION.search(s):
        s = FRACTION.sub(r"((\1)/(\2))", s)
    if leftover := re.sub(r"[\s\d.A-Za-z*/()+,-]", "", s):
        raise ValueError(f"cannot read {tex!r}: {leftover!r} left")
    out: list[str] = []
    for token in TOKEN.findall(s):
        operand_before = out and (out[-1][-1].isalnum() or out[-1] == ")") and out[-1] not in ("**", "M")
        if operand_before and (token[0].isalnum() or token == "("):
            out.append("*")
        out.append(token)
    return "".join(out)


def ffn(v: dict) -> st.Ffn:
    return st.Ffn(batch=v["B"], d_model=v["D"], d_ff=v["F"])


def points(count: int = 4):
    rng = random.Random(40)
    for _ in range(count):
        v = dict(B=rng.uniform(1e3, 1e6), F=rng.uniform(1e3, 1e5), D=rng.uniform(1e3, 1e4), C=rng.uniform(1e14, 1e16),
                 W=rng.uniform(1e10, 1e12), S=rng.uniform(1e6, 1e9), P=rng.randint(2, 16), Q=rng.randint(2, 16))
        v["N"] = rng.randint(2, 64)
        v["R"] = 3 * v["B"] * v["F"] * v["W"] / v["C"]
        yield v


def _pq(v: dict) -> dict:
    """The 2-D answers' N is N_FSDP·N_TP."""
    return {**v, "N": v["P"] * v["Q"]}


# problem -> {LaTeX fragment as rendered: NAME, or one entry per side of its relations}
FORMULAS: dict[str, dict[str, tuple[Side, ...] | None]] = {
    "alternate_ring_all_reduce": {
        r"T_{\text{alternate}} = (N-1)\,\frac{S}{W}.": (SKIP, lambda v: st.alternate_all_reduce_s(v["S"], v["N"], v["W"])),
        "N-1": (lambda v: st.alternate_all_reduce_s(v["S"], v["N"], v["W"]) * v["W"] / v["S"],),
        "S/N": (lambda v: st.ring_gather_s(v["S"], v["N"], v["W"]) * v["W"] / (v["N"] - 1),),
        "S/W": (lambda v: st.alternate_all_reduce_s(v["S"], 2, v["W"]),),
        "N/2": (lambda v: st.alternate_all_reduce_s(v["S"], v["N"], v["W"]) / st.ring_all_reduce_s(v["S"], v["N"], v["W"]),),
        r"2\frac{N-1}{N}\frac{S}{W}": (lambda v: st.ring_all_reduce_s(v["S"], v["N"], v["W"]),),
        "S": NAME, "x^{(j)}": NAME,
    },
    "data_parallel_calcs": {
        r"\dfrac{12\,B D D_{FF}}{N_{DP}}": (lambda v: st.backward_flops(ffn(v), v["N"]),),
        r"2\frac{B}{N_{DP}} D D_{FF}": (lambda v: st.Ffn(v["B"] / v["N"], v["D"], v["F"]).matmul_flops(),),
        r"T_{comm} = 2\,\dfrac{N_{DP}-1}{N_{DP}} \cdot \dfrac{6 D D_{FF}}{W} = \dfrac{12 (N_{DP}-1) D D_{FF}}{N_{DP} W}":
            (SKIP, lambda v: st.dp_backward_comm_s(ffn(v), v["N"], v["W"]),
             lambda v: st.dp_backward_comm_s(ffn(v), v["N"], v["W"])),
        "3DD_{FF}": (lambda v: ffn(v).weight_bytes / st.ELEMENT_BYTES,),
        "6DD_{FF}": (lambda v: ffn(v).weight_bytes,),
        r"N_{DP} \le 1 + \dfrac{B W}{C}": (SKIP, lambda v: st.dp_max_devices(ffn(v), v["C"], v["W"])),
        r"\frac{12BDD_{FF}}{N_{DP}C} \ge \frac{12(N_{DP}-1)DD_{FF}}{N_{DP}W}":
            (lambda v: st.backward_flops(ffn(v), v["N"]) / v["C"], lambda v: st.dp_backward_comm_s(ffn(v), v["N"], v["W"])),
        r"\frac{12DD_{FF}}{N_{DP}}": (lambda v: st.backward_flops(ffn(v), v["N"]) / v["B"],),
        r"\frac{B}{C} \ge \frac{N_{DP}-1}{W}":
            (lambda v: st.backward_flops(ffn(v), v["N"]) / v["C"] / (st.backward_flops(ffn(v), v["N"]) / v["B"]),
             lambda v: st.dp_backward_comm_s(ffn(v), v["N"], v["W"]) / (st.backward_flops(ffn(v), v["N"]) / v["B"])),
        "dz": NAME, "dx": NAME, "dW_3, dW_2, dW_1": NAME, "B/N_{DP}": NAME, "B": NAME, "W": NAME, "N": NAME,
    },
    "fsdp_calcs": {
        r"\dfrac{12\,B D D_{FF}}{N_{FSDP}}": (lambda v: st.backward_flops(ffn(v), v["P"]),),
        r"\dfrac{6\,B D D_{FF}}{N_{FSDP}}": (lambda v: st.forward_flops(ffn(v), v["P"]),),
        r"T = 2 \cdot \dfrac{N_{FSDP}-1}{N_{FSDP}} \cdot \dfrac{6DD_{FF}}{W}":
            (SKIP, lambda v: st.fsdp_backward_comm_s(ffn(v), v["P"], v["W"])),
        r"\frac{N-1}{N}": (lambda v: st.ring_gather_s(1.0, v["N"], 1.0),),
        "6DD_{FF}": (lambda v: ffn(v).weight_bytes,),
        r"T = \dfrac{N_{FSDP}-1}{N_{FSDP}} \cdot \dfrac{6DD_{FF}}{W}": (SKIP, lambda v: st.fsdp_forward_comm_s(ffn(v), v["P"], v["W"])),
        r"N_{FSDP} \le 1 + \dfrac{BW}{C}": (SKIP, lambda v: st.dp_max_devices(ffn(v), v["C"], v["W"])),
        "12DD_{FF}/N": (lambda v: st.backward_flops(ffn(v), v["N"]) / v["B"],),
        "B/N_{FSDP}": NAME, "B/N": NAME, "N": NAME,
    },
    "tp_calcs": {
        r"\dfrac{6BDD_{FF}}{N_{TP}}": (lambda v: st.forward_flops(ffn(v), v["Q"]),),
        r"\dfrac{12BDD_{FF}}{N_{TP}}": (lambda v: st.backward_flops(ffn(v), v["Q"]),),
        r"\dfrac{4(N_{TP}-1)BD}{N_{TP}W}": (lambda v: st.tp_comm_s(ffn(v), v["Q"], v["W"]),),
        "2BD": (lambda v: ffn(v).activation_bytes,),
        r"N_{TP} \le 1 + \dfrac{3D_{FF}W}{C}": (SKIP, lambda v: st.tp_max_devices_backward(ffn(v), v["C"], v["W"])),
        r"N_{TP} \le 1 + \dfrac{3D_{FF}W}{2C}": (SKIP, lambda v: st.tp_max_devices_forward(ffn(v), v["C"], v["W"])),
        # (d): both sides times N_TP/(BD), so that B and D cancel.
        "12D_{FF}/C": (lambda v: st.backward_flops(ffn(v), v["Q"]) / v["C"] * v["Q"] / (v["B"] * v["D"]),),
        "6D_{FF}/C": (lambda v: st.forward_flops(ffn(v), v["Q"]) / v["C"] * v["Q"] / (v["B"] * v["D"]),),
        "4(N_{TP}-1)/W": (lambda v: st.tp_comm_s(ffn(v), v["Q"], v["W"]) * v["Q"] / (v["B"] * v["D"]),),
        **dict.fromkeys([
            "i", "dy", "y", "x", "x_1^{(i)}", "x_2^{(i)}", "z^{(i)}", "D_{FF}", "dx", "D_{FF}/N_{TP}", "[B, D]", "B", "D",
            "N", r"dz^{(i)} = dy\,W_3^{(i)\top} \quad [B, D_{FF}/N_{TP}]",
            r"dx_2^{(i)} = dz^{(i)} * f(x_1^{(i)}), \qquad dx_1^{(i)} = dz^{(i)} * f'(x_1^{(i)}) * x_2^{(i)}",
            r"dW_3^{(i)} = z^{(i)\top} dy, \qquad dW_2^{(i)} = x^\top dx_2^{(i)}, \qquad dW_1^{(i)} = x^\top dx_1^{(i)}",
            r"dx^{(i)} = dx_1^{(i)} W_1^{(i)\top} + dx_2^{(i)} W_2^{(i)\top}, \qquad dx = \text{all-reduce}\big(\{dx^{(i)}\}_{i=0}^{N_{TP}-1}\big)."],
            NAME),
    },
    "fsdp_tp_calcs": {
        r"\dfrac{6BDD_{FF}}{N_{FSDP}N_{TP}}": (lambda v: st.forward_flops(ffn(v), v["P"] * v["Q"]),),
        r"T = \max\left(\dfrac{N_{FSDP}-1}{N_{FSDP}} \cdot \dfrac{6DD_{FF}}{N_{TP}W},\ \ 2\,\dfrac{N_{TP}-1}{N_{TP}} \cdot \dfrac{2BD}{N_{FSDP}W}\right)":
            (SKIP, lambda v: max(st.fsdp_tp_forward_comm_s(ffn(v), v["P"], v["Q"], v["W"]))),
        "6DD_{FF}/N_{TP}": (lambda v: st.fsdp_tp_forward_comm_s(ffn(v), v["P"], v["Q"], v["W"])[0] * v["W"] * v["P"] / (v["P"] - 1),),
        r"T_{comp} = \frac{6BDD_{FF}}{N C}": (SKIP, lambda v: st.forward_flops(ffn(v), v["N"]) / v["C"]),
        "6DD_{FF}/N": (lambda v: ffn(v).weight_bytes / v["N"],),
        "2BD/N": (lambda v: ffn(v).activation_bytes / v["N"],),
        r"N_{FSDP} - 1 \le \frac{BW}{C}, \qquad N_{TP} - 1 \le \frac{3D_{FF}W}{2C},":
            (SKIP, lambda v: st.dp_max_devices(ffn(v), v["C"], v["W"]) - 1,
             SKIP, lambda v: st.tp_max_devices_forward(ffn(v), v["C"], v["W"]) - 1),
        r"N \le \Big(1 + \frac{BW}{C}\Big)\Big(1 + \frac{3D_{FF}W}{2C}\Big) \approx \frac{3BD_{FF}W^2}{2C^2}.":
            (SKIP, lambda v: st.fsdp_tp_max_devices_overlapped(ffn(v), v["C"], v["W"])[0],
             lambda v: (st.dp_max_devices(ffn(v), v["C"], v["W"]) - 1) * (st.tp_max_devices_forward(ffn(v), v["C"], v["W"]) - 1)),
        # (d): the serial condition times N·W/(2D).
        r"3D_{FF}(N_{FSDP}-1) + 2B(N_{TP}-1) \le R := \frac{3BD_{FF}W}{C}":
            (lambda v: sum(st.fsdp_tp_forward_comm_s(ffn(v), v["P"], v["Q"], v["W"])) * v["P"] * v["Q"] * v["W"] / (2 * v["D"]),
             SKIP, lambda v: st.forward_flops(ffn(v), v["P"] * v["Q"]) / v["C"] * v["P"] * v["Q"] * v["W"] / (2 * v["D"])),
        "(R + 3D_{FF} + 2B)/2": (lambda v: 3 * v["F"] * st.fsdp_tp_max_devices_serial(ffn(v), v["C"], v["W"])[1],),
        r"N \le \frac{(3BD_{FF}W/C + 3D_{FF} + 2B)^2}{24\,BD_{FF}} \approx \frac{3BD_{FF}W^2}{8C^2},":
            (SKIP, lambda v: st.fsdp_tp_max_devices_serial(ffn(v), v["C"], v["W"])[0],
             lambda v: (st.dp_max_devices(ffn(v), v["C"], v["W"]) - 1) * (st.tp_max_devices_forward(ffn(v), v["C"], v["W"]) - 1) / 4),
        **dict.fromkeys([
            "x^{(j)}", "B/N_{FSDP}", "D_{FF}/N_{TP}", "y^{(i,j)}", "[B/N_{FSDP}, D]", "N = N_{FSDP}N_{TP}", "NW/2D",
            "N_{FSDP}N_{TP}", "3D_{FF}N_{FSDP}", "2BN_{TP}", "B", "D_{FF}", "C", "W", "N_{TP}",
            r"[B/N_{FSDP}, D] \times [D, D_{FF}/N_{TP}]"], NAME),
    },
}


def fragments(problem: str) -> list[str]:
    text = answers(README.read_text())[problem]
    return [(a or b).strip() for a, b in re.findall(r"\$\$(.+?)\$\$|\$(.+?)\$", text, flags=re.S)]


def sides(fragment: str) -> list[str]:
    """The sides of every relation in a fragment (clauses split at \\qquad), in order."""
    return [side for clause in fragment.split(r"\qquad") for side in RELATION.split(clause)]


@pytest.mark.parametrize("problem", FORMULAS)
def test_every_fragment_of_the_answer_is_a_known_formula_or_name(problem):
    found, known = set(fragments(problem)), set(FORMULAS[problem])
    assert not found - known, f"{problem}: maths no test reads back: {sorted(found - known)}"
    assert not known - found, f"{problem}: registered but no longer in the answer: {sorted(known - found)}"


@pytest.mark.parametrize("problem", FORMULAS)
def test_every_formula_of_the_answer_equals_the_function_the_tests_check(problem):
    for fragment, expected in FORMULAS[problem].items():
        if expected is NAME:
            continue
        parts = sides(fragment)
        assert len(parts) == len(expected), f"{problem}: {fragment!r} has {len(parts)} sides, registered {len(expected)}"
        for part, function in zip(parts, expected):
            if function is SKIP:
                continue
            expression = python_of(part)
            for v in points():
                v = _pq(v) if problem == "fsdp_tp_calcs" else v
                assert eval(expression, {"M": max}, v) == pytest.approx(function(v), rel=1e-12), (problem, fragment, part)


def test_a_changed_constant_in_an_intermediate_formula_is_caught():
    """data_parallel_calcs (a) with 13 for 12: unregistered, and its value is not backward_flops'."""
    typo = r"\dfrac{13\,B D D_{FF}}{N_{DP}}"
    assert typo not in FORMULAS["data_parallel_calcs"]
    v = next(points())
    assert eval(python_of(typo), {}, v) != pytest.approx(st.backward_flops(ffn(v), v["N"]), rel=1e-6)
