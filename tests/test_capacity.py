"""The capacity formulas (cs336_systems/capacity) against hand counts, brute force and the Scaling Book.

Each formula is checked against an independent computation: parameters and saved activations
counted layer by layer from the weight shapes, per-device times from the shapes of each device's
matmuls and collectives, every closed-form bound against a scan of the quantity it bounds, and the
mixed FSDP/TP quadratic against the numbers the Scaling Book publishes for its own example. The last
tests render the section of the writeup that answers communication_accounting.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from cs336_systems.capacity import (
    Chip,
    FeedForwardStack,
    Mesh,
    MixedPrecision,
    best_split_fsdp_degree,
    best_split_min_tokens_per_device,
    compute_bound_fsdp_range,
    devices_worth,
    forward_times,
    fsdp_bytes_per_device,
    max_tensor_degree,
    max_tokens_for_any_fsdp,
    min_compute_bound_tokens,
    min_fsdp_devices,
    parameter_count,
    pipeline_bubble_fraction,
    saved_activation_bytes,
    saved_activation_bytes_per_token,
    smallest_compute_bound_batch,
    training_state_bytes,
)
from cs336_systems.capacity.handout import (
    H100,
    HANDOUT_PRECISION,
    TPU_V5P,
    VARIANTS,
    XXL,
    XXL_MESH,
    decimal_reading,
)
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.render import heading
from cs336_systems.writeup.communication_accounting_section import communication_accounting_page

pytestmark = pytest.mark.problem("beyond")

D, F, L = 16384, 53248, 126  # the handout's XXL, typed again here as the independent reference
SMALL = FeedForwardStack(d_model=6, d_ff=10, num_blocks=3)


def block_weight_shapes(model: FeedForwardStack) -> list[tuple[int, int]]:
    """(in, out) of every linear layer, block by block."""
    return [shape for _ in range(model.num_blocks) for shape in ((model.d_model, model.d_ff),
                                                                 (model.d_ff, model.d_model))]


# --- memory ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", [SMALL, XXL])
def test_parameters_and_state_count_every_weight_matrix(model):
    weights = sum(i * o for i, o in block_weight_shapes(model))
    assert parameter_count(model) == weights
    # FP32 master copy, FP32 gradient, FP32 Adam m and v.
    assert training_state_bytes(model, HANDOUT_PRECISION) == weights * (4 + 4 + 4 + 4)
    assert training_state_bytes(model, replace(HANDOUT_PRECISION, optimizer_moments=0)) == weights * 8


def test_xxl_matches_the_handout_shape():
    assert (XXL.d_model, XXL.d_ff, XXL.num_blocks) == (D, F, L)
    assert parameter_count(XXL) == L * 2 * D * F


@pytest.mark.parametrize("model", [SMALL, XXL])
def test_saved_activations_are_the_inputs_of_every_linear_layer(model):
    inputs_per_token = sum(i for i, _ in block_weight_shapes(model))  # BF16, 2 bytes each
    assert saved_activation_bytes_per_token(model, HANDOUT_PRECISION) == 2 * inputs_per_token
    assert saved_activation_bytes(model, HANDOUT_PRECISION, 7) == 7 * 2 * inputs_per_token
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        saved_activation_bytes(model, HANDOUT_PRECISION, -1)


def test_h100s_worth_of_state():
    state = L * 2 * D * F * 16
    assert devices_worth(state, H100) == pytest.approx(state / (80 * 2**30))
    assert devices_worth(state, decimal_reading(H100, 80)) == pytest.approx(state / 80e9)


def test_fsdp_memory_splits_state_and_half_the_activations():
    n, tokens = 8, 100
    state = training_state_bytes(SMALL, HANDOUT_PRECISION)
    acts = saved_activation_bytes(SMALL, HANDOUT_PRECISION, tokens)
    assert fsdp_bytes_per_device(SMALL, HANDOUT_PRECISION, n, tokens) == pytest.approx(
        state / n + acts / 2 / n + acts / 2)
    assert fsdp_bytes_per_device(SMALL, HANDOUT_PRECISION, n, tokens, sharded_activations=1) == pytest.approx(
        (state + acts) / n)


def scan_fsdp_devices(chip: Chip, tokens: float, limit: int = 10_000) -> int | None:
    for n in range(1, limit):
        if fsdp_bytes_per_device(XXL, HANDOUT_PRECISION, n, tokens) < chip.hbm_bytes:
            return n
    return None


@pytest.mark.parametrize("tokens", [0, 1, 400, 1582, 5000, 11_000])
@pytest.mark.parametrize("chip", [TPU_V5P, decimal_reading(TPU_V5P, 95)], ids=["GiB", "decimal"])
def test_least_fsdp_degree_is_the_first_that_fits(chip, tokens):
    assert min_fsdp_devices(XXL, HANDOUT_PRECISION, chip, tokens) == scan_fsdp_devices(chip, tokens)


def test_no_fsdp_degree_fits_beyond_the_token_limit():
    limit = max_tokens_for_any_fsdp(XXL, HANDOUT_PRECISION, TPU_V5P)
    assert limit == pytest.approx(95 * 2**30 / (L * (D + F) * 2 / 2))
    assert min_fsdp_devices(XXL, HANDOUT_PRECISION, TPU_V5P, 1.01 * limit) is None
    assert scan_fsdp_devices(TPU_V5P, 1.01 * limit, limit=100_000) is None
    assert min_fsdp_devices(XXL, HANDOUT_PRECISION, TPU_V5P, 0.99 * limit) is not None


# --- forward-pass times ---------------------------------------------------------------------------

def test_times_follow_each_devices_matmuls_and_collectives():
    c, w = TPU_V5P.rates()
    x, y, mx, my, tokens = 16, 4, 2, 1, 4096
    t = forward_times(XXL, TPU_V5P, Mesh(x, y, mx, my), HANDOUT_PRECISION, tokens)
    rows = tokens / x
    flops = L * (2 * rows * D * (F / y) + 2 * rows * (F / y) * D)  # In·W_in slice, Tmp slice·W_out slice
    assert t.math_s == pytest.approx(flops / c)
    gathered = L * 2 * (D * F / y) * 2  # both weight slices per block, BF16
    assert t.fsdp_s == pytest.approx(gathered / (w * mx))
    moved = L * 2 * rows * D * 2  # In gathered, Out reduce-scattered, BF16
    assert t.tp_s == pytest.approx(moved / (w * my))
    assert t.comm_s() == t.fsdp_s + t.tp_s and t.comm_s(overlap_collectives=True) == max(t.fsdp_s, t.tp_s)


def first_compute_bound(mesh: Mesh, overlap: bool, precision: MixedPrecision = HANDOUT_PRECISION,
                        step: int = 1, limit: int = 60_000) -> int | None:
    for b in range(step, limit, step):
        if forward_times(XXL, TPU_V5P, mesh, precision, b).compute_bound(overlap):
            return b
    return None


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.key for v in VARIANTS])
def test_least_compute_bound_batch_matches_a_scan(variant):
    bound = min_compute_bound_tokens(XXL, TPU_V5P, variant.mesh, variant.precision, variant.overlap_collectives)
    first = first_compute_bound(variant.mesh, variant.overlap_collectives, variant.precision)
    assert first == math.ceil(bound)
    # Once compute-bound, larger batches stay so (T_math grows faster in B than T_TP).
    assert all(forward_times(XXL, TPU_V5P, variant.mesh, variant.precision, b).compute_bound(
        variant.overlap_collectives) for b in range(first, first + 3000, 7))


def test_smallest_batch_for_the_handout_mesh_splits_over_fsdp_shards():
    batch = smallest_compute_bound_batch(XXL, TPU_V5P, XXL_MESH, HANDOUT_PRECISION)
    assert batch == first_compute_bound(XXL_MESH, False, step=XXL_MESH.fsdp)
    assert batch % XXL_MESH.fsdp == 0


@pytest.mark.parametrize("activation_bytes", [2, 1])
def test_tensor_parallelism_is_hideable_up_to_a_batch_free_degree(activation_bytes):
    precision = replace(HANDOUT_PRECISION, activation_comm_bytes=activation_bytes)
    y_max = max_tensor_degree(XXL, TPU_V5P, precision, tensor_axes=1)
    if activation_bytes == 2:
        assert y_max == pytest.approx(F * 1 / (4.6e14 / 1.8e11))  # the Scaling Book's Y < M_Y·F/α
    for y in range(1, 64):
        for tokens in (10**3, 10**9):
            times = forward_times(XXL, TPU_V5P, Mesh(2, y, 2, 1), precision, tokens)
            assert (times.math_s >= times.tp_s) == (y <= y_max)


def test_too_much_tensor_parallelism_is_never_compute_bound():
    too_wide = Mesh(2, 32, 2, 1)
    assert min_compute_bound_tokens(XXL, TPU_V5P, too_wide, HANDOUT_PRECISION) is None
    assert first_compute_bound(too_wide, False, step=97, limit=2_000_000) is None


def test_best_split_is_the_minimum_over_fsdp_degrees():
    n = XXL_MESH.devices
    grid = [1 + i * 0.01 for i in range(int((n - 1) / 0.01))]
    per_device = {x: min_compute_bound_tokens(XXL, TPU_V5P, Mesh(x, n / x, 2, 1), HANDOUT_PRECISION) for x in grid}
    floors = {x: t / n for x, t in per_device.items() if t is not None}
    x_best = min(floors, key=floors.get)
    assert floors[x_best] == pytest.approx(best_split_min_tokens_per_device(XXL, TPU_V5P, HANDOUT_PRECISION, 2, 1),
                                           rel=1e-4)
    assert x_best == pytest.approx(best_split_fsdp_degree(XXL, TPU_V5P, HANDOUT_PRECISION, n, 1), abs=0.01)


def test_quadratic_reproduces_the_scaling_books_example():
    # Scaling Book, Part 5, "Mixed FSDP and Tensor Parallelism": a v5p 4x4x4 slice (N = 64), F = 32,768,
    # B = 48,000, alpha = 2550, M_X = 2, M_Y = 1 gives X = 31.7; its floor 2·2550²/F is "around 396".
    book = Chip("alpha 2550", 1.0, flops_per_s=2550.0, ici_bytes_per_s=1.0)
    model = FeedForwardStack(8192, 32768, 1)
    low, high = compute_bound_fsdp_range(model, book, HANDOUT_PRECISION, 48_000, 64, 2, 1)
    assert round(high, 1) == 31.7
    assert best_split_min_tokens_per_device(model, book, HANDOUT_PRECISION, 2, 1) == pytest.approx(
        2 * 2550**2 / 32768) and round(2 * 2550**2 / 32768) in range(396, 398)
    for x in (low * 0.9, low * 1.1, (low + high) / 2, high * 0.95, high * 1.05):
        t = forward_times(model, book, Mesh(x, 64 / x, 2, 1), HANDOUT_PRECISION, 48_000)
        assert t.compute_bound() == (low <= x <= high)


def test_pipeline_bubble_matches_a_simulated_schedule():
    for stages, micro in ((1, 1), (4, 16), (3, 5), (8, 2)):
        finish = [[0.0] * micro for _ in range(stages)]  # forward of micro-batch j on stage i, unit time each
        for i in range(stages):
            for j in range(micro):
                finish[i][j] = max(finish[i - 1][j] if i else 0.0, finish[i][j - 1] if j else 0.0) + 1.0
        assert pipeline_bubble_fraction(stages, micro) == pytest.approx((finish[-1][-1] - micro) / micro)


def test_inputs_are_validated():
    with pytest.raises(ValueError, match="d_ff must be > 0"):
        FeedForwardStack(4, 0, 1)
    with pytest.raises(ValueError, match="has no FLOP/s or link bandwidth"):
        H100.alpha
    with pytest.raises(ValueError, match="n_fsdp must be >= 1"):
        fsdp_bytes_per_device(SMALL, HANDOUT_PRECISION, 0, 1)


# --- the writeup page -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def page(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("communication_accounting")
    first = render_writeup(root / "no-results", root / "a", pages=[communication_accounting_page])
    second = render_writeup(root / "no-results", root / "b", pages=[communication_accounting_page])
    assert first.text() == second.text()
    readme = first.readme.read_text()
    return {"answer": readme.split(heading("communication_accounting") + "\n")[1].split("\n## ")[0],
            "details": first.details[0].read_text()}


def test_the_answer_gives_every_part_with_its_numbers(page):
    answer = page["answer"]
    assert [p for p in ("**(a)**", "**(b)**", "**(c)**", "**(d)**") if p in answer] == ["**(a)**", "**(b)**",
                                                                                        "**(c)**", "**(d)**"]
    state = L * 2 * D * F * 16
    assert f"{L * 2 * D * F:,}".replace(",", "{,}") in answer
    assert f"= {state / 2**30:.0f} \\text{{ GB}}" in answer
    assert f"The state fills {math.ceil(state / (80 * 2**30))} H100s ({math.ceil(state / 80e9)} if GB means 10⁹ bytes)" in answer
    assert f"{L * (D + F) * 2 / 2**20:.2f} \\text{{ MB per token}}" in answer
    assert f"$N_{{FSDP}}$ = {math.floor(state / (95 * 2**30)) + 1} (" in answer and "if GB means 10⁹ bytes) with negligible" in answer
    alpha = 4.6e14 / 1.8e11
    per_device = (F / (4 * 2)) / (F / (64 * alpha) - 1 / (16 * 1)) / 64
    assert f"Compute-bound from {per_device:.1f} tokens per device" in answer
    assert f"FSDP and TP overlapped ({16 * alpha / 2 / 64:.1f})" in answer
    # The pipeline variant: 4 stages of X = Y = 4 (16 devices each), 16 micro-batches, the bubble against the ideal
    # step. Its floor holds only with a stage's weights resident; gathered per micro-batch, each micro-batch would
    # need the stage's whole floor (the same expression on the stage's mesh).
    details = page["details"]
    assert f"a {3 / 16:.1%} bubble" in answer and f"$(p-1)/m$ = {3 / 16:.1%} of the ideal step" in details
    stage_batch = math.ceil((F / 8) / (F / (16 * alpha) - 1 / 4))
    assert "pipeline stages that keep their weights resident" in answer
    assert f"would have to clear the {stage_batch:,}-token floor itself" in details


def test_the_details_hold_the_tables_and_references(page):
    details = page["details"]
    assert details.startswith("# communication_accounting:")
    assert details.count("| ---: |") + details.count("| :--- |") >= 3  # (b), (c) and (d) tables
    for variant in VARIANTS:
        assert f"| {variant.name} |" in details
    assert "| 0 | none (state only) | 0 | 35 | 38 |" in details
    for reference in ("Narayanan et al. 2021", "Rajbhandari et al. 2020", "Austin et al. 2025", "ZeRO++"):
        assert reference in details
    assert "GiB" not in details.replace("95 GiB of HBM", "")  # one unit system: GB = 2^30 bytes
