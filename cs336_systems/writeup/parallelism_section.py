"""The 2026 handout's section 8 (analyzing parallelism strategies): five written problems, each formula checked.

The ring times come from the simulator (:mod:`cs336_systems.capacity.ring`) and the FLOPs from
torch's FlopCounterMode (:mod:`cs336_systems.capacity.ffn_check`), both run here, deterministically;
the bytes each rank sends come from ``ffn_bytes.json`` (``scripts/measure_ffn_bytes.py``). The same
checks run in ``tests/test_parallelism.py``. Words in ``templates/answers/<problem>.md.j2`` and
``templates/details/parallelism.md.j2``.
"""

from __future__ import annotations

from cs336_systems.capacity import ffn_check as fc
from cs336_systems.capacity import ring
from cs336_systems.capacity import strategies as st
from cs336_systems.capacity.ffn_bytes import HEADER_ALLOWANCE, FfnBytesRecord, FfnBytesSetting
from cs336_systems.writeup import fmt, templating
from cs336_systems.writeup.context import Page, RenderContext, details_link

PROBLEMS = ("alternate_ring_all_reduce", "data_parallel_calcs", "fsdp_calcs", "tp_calcs", "fsdp_tp_calcs")
FLOP_CASES = (("DP", 4, 1), ("FSDP", 8, 1), ("TP", 1, 4), ("FSDP+TP", 4, 2))  # (strategy, N_FSDP or N_DP, N_TP)


def _fraction(value) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


# Steps each algorithm takes on N devices, as section 8.1 counts them; the simulator must take as many.
RING_STEPS = {"all-gather": lambda n: n - 1, "reduce-scatter": lambda n: n - 1, "all-reduce": lambda n: 2 * (n - 1),
              "alternate all-reduce": lambda n: n - 1}


def _ring_table() -> tuple[str, bool]:
    """The simulated times, and whether every simulation summed right, took the steps counted and
    (following from those steps and the message sizes it was given) the closed form's time."""
    sims = ring.simulate_all()
    by = {(s.collective, s.devices): s for s in sims}
    rows = [[n, *(_fraction(by[c, n].time_s) for c in ring.COLLECTIVES)] for n in ring.DEVICE_COUNTS]
    exact = all(s.correct and s.steps == RING_STEPS[s.collective](s.devices) and s.time_s == s.closed_form_s
                for s in sims)
    return fmt.table(["N", *(f"{c} (S/W)" for c in ring.COLLECTIVES)], rows), exact


def _flops_table(shape: st.Ffn) -> tuple[str, bool]:
    rows, exact = [], True
    for strategy, n_fsdp, n_tp in FLOP_CASES:
        forward, backward = fc.count_flops(strategy, shape, n_fsdp, n_tp)
        want = st.forward_flops(shape, n_fsdp * n_tp), st.backward_flops(shape, n_fsdp * n_tp)
        exact &= (forward, backward) == want
        rows.append([strategy, n_fsdp if strategy != "TP" else "–", n_tp if "TP" in strategy else "–",
                     f"{forward:,}", f"{int(want[0]):,}", f"{backward:,}", f"{int(want[1]):,}"])
    return fmt.table(["strategy", "$N_{DP}$ or $N_{FSDP}$", "$N_{TP}$", "forward, counted", "$6BDD_{FF}/N$",
                      "backward, counted", "$12BDD_{FF}/N$"], rows), exact


def _bytes(ctx: RenderContext) -> dict | None:
    runs = ctx.inputs.runs(FfnBytesRecord.KIND)
    if not runs:
        ctx.not_measured("gloo on this machine's CPUs", "bytes each rank sends in section 8's FFN",
                         "python scripts/measure_ffn_bytes.py")
        return None
    machine, results = runs[-1]
    setting = FfnBytesSetting(**{k: tuple(v) if isinstance(v, list) else v for k, v in results.setting.items()})
    records: list[FfnBytesRecord] = results.records

    def cells(sent: list[int], term: float) -> list[str]:
        shown = f"{sent[0]:,}" if len(set(sent)) == 1 else f"{min(sent):,}–{max(sent):,}"
        return [shown, f"{term:,.0f}"]

    rows = [[r.strategy, r.world_size, *cells(r.forward_bytes, r.expected_forward_bytes),
             *cells(r.backward_bytes, r.expected_backward_bytes), fmt.pct(r.excess(), 2),
             fmt.sig(r.max_gradient_error, 2) if r.strategy in fc.MEASURED else "–"] for r in records]
    measured = [r for r in records if r.strategy in fc.MEASURED]
    gloo = [r for r in records if r.strategy == fc.GLOO_REDUCE_SCATTER]
    return dict(
        source=results.source, shape=setting.ffn, world_sizes=setting.world_sizes, env=results.environment,
        setting=fmt.setting_line(results.environment, results.source, parts=[
            "backend gloo", f"world sizes {', '.join(map(str, setting.world_sizes))}",
            f"B = {setting.batch}, D = {setting.d_model}, D_FF = {setting.d_ff}, FP16 on the wire"]),
        table=fmt.table(["strategy", "ranks", "forward bytes", "term", "backward bytes", "term", "largest excess",
                         "gradient error"], rows, align="lrrrrrrr"),
        all_match=all(r.matches() for r in measured), worst=max(r.excess() for r in measured),
        gloo_ratio=[b / r.expected_backward_bytes for r in gloo for b in r.backward_bytes],
        by={(r.strategy, r.world_size): r for r in records})


def _bounds() -> tuple[str, dict]:
    ffn = st.LEADERBOARD_FFN
    found, rows = {}, []
    for chip in st.ACCELERATORS:
        c, w = chip.flops_per_s, chip.egress_bytes_per_s
        b = dict(chip=chip, alpha=c / w, dp=st.dp_max_devices(ffn, c, w), tp_bwd=st.tp_max_devices_backward(ffn, c, w),
                 tp_fwd=st.tp_max_devices_forward(ffn, c, w), overlapped=st.fsdp_tp_max_devices_overlapped(ffn, c, w),
                 serial=st.fsdp_tp_max_devices_serial(ffn, c, w))
        found[chip.name] = b
        rows.append([chip.name, fmt.sig(c / 1e12, 4), fmt.sig(w / 1e9, 3), fmt.sig(c / w, 4), fmt.sig(b["dp"], 3),
                     fmt.sig(b["tp_bwd"], 3), fmt.sig(b["tp_fwd"], 3),
                     f"{fmt.sig(b['overlapped'][0], 3)} ({fmt.sig(b['overlapped'][1], 3)} × {fmt.sig(b['overlapped'][2], 3)})",
                     f"{fmt.sig(b['serial'][0], 3)} ({fmt.sig(b['serial'][1], 3)} × {fmt.sig(b['serial'][2], 3)})"])
    table = fmt.table(["chip", "$C$ (TFLOP/s)", "$W$ (10⁹ B/s)", "$C/W$", "DP, FSDP: $1 + BW/C$",
                       "TP backward: $1 + 3D_{FF}W/C$", "TP forward: $1 + 3D_{FF}W/(2C)$",
                       "2D overlapped ($N_{FSDP} × N_{TP}$)", "2D serial ($N_{FSDP} × N_{TP}$)"], rows, align="lrrrrrrrr")
    return table, found


def parallelism_page(ctx: RenderContext) -> Page:
    """The five answers (expression, justification, the check that ran) and the derivations with every check's numbers."""
    shape = FfnBytesSetting().ffn
    ring_table, ring_exact = _ring_table()
    flops_table, flops_exact = _flops_table(shape)
    bounds_table, bounds = _bounds()
    values = dict(ring_table=ring_table, ring_exact=ring_exact, devices=ring.DEVICE_COUNTS, flops_table=flops_table,
                  flops_exact=flops_exact, flop_shape=shape, bytes=_bytes(ctx), bounds_table=bounds_table,
                  bounds=bounds, b200=bounds[st.B200.name], h100=bounds[st.H100_SXM.name], ffn=st.LEADERBOARD_FFN,
                  allowance=HEADER_ALLOWANCE, link=details_link("parallelism"))
    answers = {p: templating.render(f"answers/{p}.md.j2", **values) for p in PROBLEMS}
    return Page("parallelism", templating.render("details/parallelism.md.j2", **values), answers)
