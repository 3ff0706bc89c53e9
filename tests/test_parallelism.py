"""The 2026 handout's section 8 (analyzing parallelism strategies): every formula against a program.

* the ring collectives of section 8.1, simulated step by step (cs336_systems/capacity/ring.py),
  take exactly the closed forms' times for N = 2..16 and compute the right results;
* torch's FlopCounterMode counts the closed forms' FLOPs at each strategy's sharded shapes;
* gloo ranks running DP, FSDP and TP through real collectives send the handout's bytes (plus
  gloo's small headers) and get single-process autograd's gradients;
* each bound on N is where computation time equals communication time, and 2D's best split
  without overlap beats every other split of a scan.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from cs336_systems.capacity import ffn_check as fc
from cs336_systems.capacity import ring
from cs336_systems.capacity import strategies as st
from cs336_systems.capacity.ffn_bytes import GRADIENT_TOLERANCE, HEADER_ALLOWANCE, FfnBytesSetting, measure_ffn_bytes

pytestmark = pytest.mark.problem("beyond")

CLOSED_FORM = {"all-gather": st.ring_gather_s, "reduce-scatter": st.ring_gather_s,
               "all-reduce": st.ring_all_reduce_s, "alternate all-reduce": st.alternate_all_reduce_s}


@pytest.mark.parametrize("collective", ring.COLLECTIVES)
def test_simulated_ring_takes_the_closed_form_time(collective):
    s, w = Fraction(3 * 2**20), Fraction(450 * 10**9)
    for n in ring.DEVICE_COUNTS:
        sim = ring.simulate(collective, n, s, w)
        assert sim.correct, f"{collective} on {n} devices computed the wrong result"
        assert sim.time_s == sim.closed_form_s, f"{collective}, N = {n}: {sim.time_s} s != {sim.closed_form_s} s"
        assert sim.steps == (2 if collective == "all-reduce" else 1) * (n - 1)
        assert sim.sent_bytes_per_device == sim.time_s * w  # every device sends in every step
        assert math.isclose(CLOSED_FORM[collective](float(s), n, float(w)), float(sim.time_s), rel_tol=1e-12)


def test_alternate_all_reduce_is_slower_by_n_over_2():
    for n in ring.DEVICE_COUNTS:
        alternate, ring_ = (ring.simulate(c, n, Fraction(1), Fraction(1)) for c in ("alternate all-reduce", "all-reduce"))
        assert alternate.time_s / ring_.time_s == Fraction(n, 2)


def test_a_ring_refuses_a_single_device():
    with pytest.raises(ValueError, match="at least 2 devices, got 1"):
        ring.Ring(1, Fraction(1), Fraction(1))


SHAPE = st.Ffn(batch=64, d_model=32, d_ff=128)


@pytest.mark.parametrize("strategy,n_fsdp,n_tp", [
    ("DP", 1, 1), ("DP", 4, 1), ("FSDP", 2, 1), ("FSDP", 8, 1), ("TP", 1, 2), ("TP", 1, 4),
    ("FSDP+TP", 2, 2), ("FSDP+TP", 4, 2), ("FSDP+TP", 2, 8)])
def test_counted_flops_equal_the_closed_forms(strategy, n_fsdp, n_tp):
    forward, backward = fc.count_flops(strategy, SHAPE, n_fsdp, n_tp)
    devices = n_fsdp * n_tp
    assert forward == st.forward_flops(SHAPE, devices)
    assert backward == st.backward_flops(SHAPE, devices)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_ranks_send_the_handouts_bytes(world_size):
    records = measure_ffn_bytes(FfnBytesSetting(world_sizes=(world_size,)))
    by_strategy = {r.strategy: r for r in records}
    for name in fc.MEASURED:
        r = by_strategy[name]
        assert r.matches(), (f"{name} on {world_size} ranks sent forward {r.forward_bytes}, backward "
                             f"{r.backward_bytes}; the handout's terms are {r.expected_forward_bytes:.0f} and "
                             f"{r.expected_backward_bytes:.0f} (+{HEADER_ALLOWANCE:.0%} for headers)")
        assert r.max_gradient_error < GRADIENT_TOLERANCE, f"{name}: gradients off by {r.max_gradient_error}"
    # Gloo's own reduce-scatter sends what an all-reduce does: twice the ring's term.
    gloo = by_strategy[fc.GLOO_REDUCE_SCATTER]
    assert all(1.99 < b / gloo.expected_backward_bytes < 2.0 * (1 + HEADER_ALLOWANCE) for b in gloo.backward_bytes)


def test_tp_backward_equations_equal_autograd():
    """tp_calcs (a) on one device (N_TP = 1) is the unsharded backward pass, (24)-(30)."""
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g, requires_grad=True)
    w = [torch.randn(*s, generator=g, requires_grad=True) for s in ((4, 16), (4, 16), (16, 4))]
    dy = torch.randn(8, 4, generator=g)
    fc.ffn(x, *w).backward(dy)
    with torch.no_grad():
        x1, x2 = x @ w[0], x @ w[1]
        ours = fc.tp_backward(dy, x, x1, x2, torch.nn.functional.silu(x1) * x2, *w)
    for mine, want in zip(ours, [t.grad for t in w] + [x.grad]):
        torch.testing.assert_close(mine, want)


@pytest.mark.parametrize("chip", st.ACCELERATORS, ids=lambda c: c.name)
def test_each_bound_is_where_computation_meets_communication(chip):
    ffn, c, w = st.LEADERBOARD_FFN, chip.flops_per_s, chip.egress_bytes_per_s
    cases = [  # (bound, computation time at N, communication time at N)
        (st.dp_max_devices(ffn, c, w), lambda n: st.backward_flops(ffn, n) / c, lambda n: st.dp_backward_comm_s(ffn, n, w)),
        (st.dp_max_devices(ffn, c, w), lambda n: st.forward_flops(ffn, n) / c, lambda n: st.fsdp_forward_comm_s(ffn, n, w)),
        (st.dp_max_devices(ffn, c, w), lambda n: st.backward_flops(ffn, n) / c, lambda n: st.fsdp_backward_comm_s(ffn, n, w)),
        (st.tp_max_devices_backward(ffn, c, w), lambda n: st.backward_flops(ffn, n) / c, lambda n: st.tp_comm_s(ffn, n, w)),
        (st.tp_max_devices_forward(ffn, c, w), lambda n: st.forward_flops(ffn, n) / c, lambda n: st.tp_comm_s(ffn, n, w)),
    ]
    for bound, compute, comm in cases:
        assert math.isclose(compute(bound), comm(bound), rel_tol=1e-9)
        assert compute(bound * 0.99) > comm(bound * 0.99) and compute(bound * 1.01) < comm(bound * 1.01)


@pytest.mark.parametrize("chip", st.ACCELERATORS, ids=lambda c: c.name)
def test_2d_bounds_against_a_scan_of_splits(chip):
    ffn, c, w = st.LEADERBOARD_FFN, chip.flops_per_s, chip.egress_bytes_per_s

    def largest_n(combine) -> float:
        """The largest N_FSDP·N_TP over a fine grid of N_FSDP, each with the largest N_TP that keeps
        the forward pass compute-bound (found by bisection)."""
        def bound(nf: float, nt: float) -> bool:
            return st.forward_flops(ffn, nf * nt) / c >= combine(*st.fsdp_tp_forward_comm_s(ffn, nf, nt, w))

        best = 0.0
        for k in range(1, 4001):
            nf = 1 + k * 0.05
            if not bound(nf, 1.0):
                continue
            lo, hi = 1.0, 1e6
            for _ in range(100):
                nt = (lo + hi) / 2
                lo, hi = (nt, hi) if bound(nf, nt) else (lo, nt)
            best = max(best, nf * lo)
        return best

    overlapped, nf, nt = st.fsdp_tp_max_devices_overlapped(ffn, c, w)
    fsdp, tp = st.fsdp_tp_forward_comm_s(ffn, nf, nt, w)
    assert math.isclose(fsdp, st.forward_flops(ffn, nf * nt) / c) and math.isclose(tp, fsdp)
    assert largest_n(max) == pytest.approx(overlapped, rel=1e-3)
    serial, nf, nt = st.fsdp_tp_max_devices_serial(ffn, c, w)
    assert math.isclose(sum(st.fsdp_tp_forward_comm_s(ffn, nf, nt, w)), st.forward_flops(ffn, serial) / c)
    assert largest_n(lambda a, b: a + b) == pytest.approx(serial, rel=1e-3)
    assert serial < overlapped
    # Without the "+1" terms (B and D_FF large beside C/W) the serial bound is a quarter of the overlapped one.
    big = st.Ffn(ffn.batch * 10**4, ffn.d_model, ffn.d_ff * 10**4)
    ratio = st.fsdp_tp_max_devices_serial(big, c, w)[0] / st.fsdp_tp_max_devices_overlapped(big, c, w)[0]
    assert ratio == pytest.approx(0.25, rel=1e-3)


def test_the_page_renders_every_check_as_passed(tmp_path):
    """The section 8 answers and their page, from the committed results: every check reads as passed."""
    from cs336_systems.results.paths import RESULTS_ROOT
    from cs336_systems.writeup.parallelism_section import PROBLEMS, parallelism_page
    from cs336_systems.writeup.render import render_writeup

    rendered = render_writeup(RESULTS_ROOT, tmp_path, pages=[parallelism_page])
    readme, page = rendered.readme.read_text(), (tmp_path / "details" / "parallelism.md").read_text()
    assert [line[4:].split(" (")[0] for line in readme.splitlines() if line.startswith("### ")] == list(PROBLEMS)
    for failed in ("NOT equal", "does not equal", "does NOT take", "SOME ", "Not measured"):
        assert failed not in readme + page
    assert "Every simulation takes the steps section 8.1 counts" in page and "so equals its closed form exactly" in page
    assert "Every count equals its expression" in page
