"""communication_accounting (2025, section 2.4): the XXL model's memory and forward-pass communication.

Computed, not measured, by :mod:`cs336_systems.capacity` from the handout's constants; words and equations in
``templates/answers/communication_accounting.md.j2`` and ``templates/details/communication_accounting.md.j2``.
"""

from __future__ import annotations

import math

from cs336_systems import capacity as cap
from cs336_systems.capacity.handout import H100, H100_MEMORY_GB, SHARDED_ACTIVATIONS, TPU_V5P, V5P_MEMORY_GB
from cs336_systems.capacity.handout import HANDOUT_PRECISION as PREC
from cs336_systems.capacity.handout import VARIANT, VARIANTS, XXL, decimal_reading
from cs336_systems.capacity.handout import XXL_MESH as MESH
from cs336_systems.writeup import fmt, templating
from cs336_systems.writeup.context import Page, RenderContext, details_link

# The Scaling Book's worked example for its quadratic: a 4x4x4 v5p slice, F = 32,768, B = 48,000, α = 2550.
BOOK_ALPHA, BOOK_F, BOOK_B, BOOK_N = 2550, 32768, 48000, 64
MICRO_PER_STAGE = 4  # the pipeline variant's micro-batches per stage, for its bubble


def _tex(value: float, digits: int = 3) -> str:
    """A number for LaTeX: plain below 10^7, else "m \\times 10^{e}"."""
    mantissa, _, exponent = fmt.sig(value, digits).partition("e")
    return mantissa + (rf" \times 10^{{{int(exponent)}}}" if exponent else "")


def _book() -> dict:
    """Our functions on the Scaling Book's own example, to compare with the numbers it prints."""
    chip = cap.Chip(f"alpha = {BOOK_ALPHA}", 1.0, flops_per_s=float(BOOK_ALPHA), ici_bytes_per_s=1.0)
    model = cap.FeedForwardStack(1, BOOK_F, 1)  # D and L cancel out of both results
    low, high = cap.compute_bound_fsdp_range(model, chip, PREC, BOOK_B, BOOK_N, MESH.fsdp_axes, MESH.tensor_axes)
    return dict(alpha=BOOK_ALPHA, f=BOOK_F, b=BOOK_B, low=low, high=high,
                floor=cap.best_split_min_tokens_per_device(model, chip, PREC, MESH.fsdp_axes, MESH.tensor_axes))


def _numbers() -> dict:
    batch = cap.smallest_compute_bound_batch(XXL, TPU_V5P, MESH, PREC)
    p, s = cap.parameter_count(XXL), cap.training_state_bytes(XXL, PREC)
    acts = cap.saved_activation_bytes(XXL, PREC, batch)
    h100s = [math.ceil(cap.devices_worth(b, chip)) for b, chip in
             ((s, H100), (s + acts, H100), (s, decimal_reading(H100, H100_MEMORY_GB)))]
    fits = [cap.min_fsdp_devices(XXL, PREC, chip, tokens) for chip, tokens in
            ((TPU_V5P, 0), (decimal_reading(TPU_V5P, V5P_MEMORY_GB), 0), (TPU_V5P, batch / MESH.fsdp))]
    pipe = VARIANT["pipeline"]
    stages, micro = pipe.pipeline_stages, MICRO_PER_STAGE * pipe.pipeline_stages
    axes = (MESH.fsdp_axes, MESH.tensor_axes)
    return dict(
        m=MESH, prec=PREC, model=XXL, h100_gb=H100_MEMORY_GB, v5p_gb=V5P_MEMORY_GB, f_sharded=SHARDED_ACTIVATIONS,
        p=p, s=s, s_tex=_tex(s), a=cap.saved_activation_bytes_per_token(XXL, PREC), batch=batch, acts=acts,
        h100s=h100s[0], h100s_with_acts=h100s[1], h100s_decimal=h100s[2],
        n_min=fits[0], n_min_decimal=fits[1], n_shard=fits[2], block=cap.gathered_block_bytes(XXL, PREC),
        token_limit=math.floor(cap.max_tokens_for_any_fsdp(XXL, PREC, TPU_V5P)),
        c_tex=_tex(TPU_V5P.rates()[0]), w_tex=_tex(TPU_V5P.rates()[1]), alpha=TPU_V5P.alpha,
        serial=cap.min_compute_bound_tokens(XXL, TPU_V5P, MESH, PREC),
        overlapped=cap.min_compute_bound_tokens(XXL, TPU_V5P, MESH, PREC, True),
        t=cap.forward_times(XXL, TPU_V5P, MESH, PREC, batch),
        y_max=cap.max_tensor_degree(XXL, TPU_V5P, PREC, MESH.tensor_axes),
        best=cap.best_split_min_tokens_per_device(XXL, TPU_V5P, PREC, *axes),
        best_x=cap.best_split_fsdp_degree(XXL, TPU_V5P, PREC, MESH.devices, MESH.tensor_axes), book=_book(),
        floor={v.key: cap.min_compute_bound_tokens(XXL, TPU_V5P, v.mesh, v.precision, v.overlap_collectives)
               / v.devices for v in VARIANTS},
        v=VARIANT, stages=stages, micro=micro,
        pipe_batch=cap.min_compute_bound_tokens(XXL, TPU_V5P, pipe.mesh, pipe.precision),
        # The bubble (p-1)/m is relative to the ideal step; as a share of the step it is (p-1)/(m+p-1).
        bubble=cap.pipeline_bubble_fraction(stages, micro), bubble_share=(stages - 1) / (micro + stages - 1),
        pipe_resident=p * PREC.weight_comm_bytes / (stages * pipe.mesh.tensor) + s / pipe.devices,
        replicated=cap.gathered_block_bytes(XXL, PREC, MESH.tensor) * XXL.num_blocks)


def _tables(n: dict) -> dict:
    decimal = decimal_reading(TPU_V5P, V5P_MEMORY_GB)
    cases = [(0, "none (state only)"), (n["batch"] / MESH.devices, "per device in (c), $B/N$"),
             (n["batch"] / MESH.fsdp, "per FSDP shard in (c), $B/X$"), (n["batch"], "all of (c)'s batch")]
    fits = [[fmt.sig(tokens, 4), what, fmt.gb(cap.saved_activation_bytes(XXL, PREC, tokens), 4),
             *(cap.min_fsdp_devices(XXL, PREC, chip, tokens) or "none fits" for chip in (TPU_V5P, decimal))]
            for tokens, what in cases]
    times = [[name, fmt.ms(value, 4)] for name, value in (
        ("$T_{math}$", n["t"].math_s), ("$T_{FSDP}$", n["t"].fsdp_s), ("$T_{TP}$", n["t"].tp_s),
        ("$T_{FSDP} + T_{TP}$", n["t"].comm_s()))]
    base = n["serial"]
    variants = [[v.name, v.change, fmt.sig(n["floor"][v.key], 4), f"{math.ceil(n['floor'][v.key] * v.devices):,}",
                 fmt.ratio(n["floor"][v.key] * v.devices / base)] for v in VARIANTS]
    return dict(
        fits=fmt.table(["tokens whose activations a device holds", "which", "$A$ (GB)",
                        f"least $N$ ({V5P_MEMORY_GB}·2³⁰ bytes)", f"least $N$ ({V5P_MEMORY_GB}·10⁹ bytes)"],
                       fits, align="rlrrr"),
        times=fmt.table(["forward pass at (c)'s $B$", "ms"], times),
        variants=fmt.table(["variant", "what changes", "least $B/N$", "least $B$ (tokens)", "vs. as given"],
                           variants, align="llrrr"))


def communication_accounting_page(ctx: RenderContext) -> Page:
    """The equations with their values (the answer) and the inputs, tables and checks (the details)."""
    n = _numbers()
    markdown = templating.render("details/communication_accounting.md.j2", n=n, **_tables(n))
    answer = templating.render("answers/communication_accounting.md.j2", n=n,
                               link=details_link("communication_accounting"))
    return Page("communication_accounting", markdown, {"communication_accounting": answer})
