"""Problem communication_accounting (2025, section 2.4): the XXL model's memory and forward-pass communication.

A written problem: nothing is measured. Every number is computed when the page renders by
:mod:`cs336_systems.capacity` from the handout's constants (:mod:`cs336_systems.capacity.handout`),
and shown with the equation that gives it.
"""

from __future__ import annotations

import math

from cs336_systems.capacity import (
    Chip,
    FeedForwardStack,
    best_split_fsdp_degree,
    best_split_min_tokens_per_device,
    compute_bound_fsdp_range,
    devices_worth,
    forward_times,
    gathered_block_bytes,
    max_tensor_degree,
    max_tokens_for_any_fsdp,
    min_compute_bound_tokens,
    min_fsdp_devices,
    parameter_count,
    pipeline_bubble_fraction,
    saved_activation_bytes,
    saved_activation_bytes_per_token,
    smallest_compute_bound_batch,
    state_bytes_per_parameter,
    training_state_bytes,
)
from cs336_systems.capacity.handout import H100, H100_MEMORY_GB, SHARDED_ACTIVATIONS, TPU_V5P, V5P_MEMORY_GB
from cs336_systems.capacity.handout import HANDOUT_PRECISION as PREC
from cs336_systems.capacity.handout import VARIANT, VARIANTS, XXL, decimal_reading
from cs336_systems.capacity.handout import XXL_MESH as MESH
from cs336_systems.units import GB, MB
from cs336_systems.writeup import fmt
from cs336_systems.writeup.context import RenderContext, Section

HEADING = "## communication_accounting: memory and communication of the XXL model under FSDP and tensor parallelism"
BOOK = "the Scaling Book (Austin et al. 2025, *How to Scale Your Model*, Part 5)"
MEGATRON = "Narayanan et al. 2021, *Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM*"
ZERO = "Rajbhandari et al. 2020, *ZeRO*"
ZERO_PP = "G. Wang et al. 2023, *ZeRO++: Extremely Efficient Collective Communication for Giant Model Training*"
COLLECTIVE_MATMUL = ("S. Wang et al. 2023, *Overlap Communication with Dependent Computation via Decomposition in "
                     "Large Deep Learning Models*, ASPLOS")
# The book's worked example for its quadratic: a 4x4x4 v5p slice, F = 32,768, B = 48,000 tokens, α = 2550.
BOOK_ALPHA, BOOK_F, BOOK_B, BOOK_N = 2550, 32768, 48000, 64
NONE_FITS = "none fits"


def _tex(value: float, digits: int = 3) -> str:
    """A number for LaTeX: plain below 10^7, else "m \\times 10^{e}"."""
    text = fmt.sig(value, digits)
    if "e" not in text:
        return text
    mantissa, exponent = text.split("e")
    return rf"{mantissa} \times 10^{{{int(exponent)}}}"


def _int(n: int, tex: bool = False) -> str:
    return f"{n:,}".replace(",", "{,}" if tex else ",")


def _gib(n_bytes: float, digits: int = 4) -> str:
    return f"{fmt.sig(n_bytes / GB, digits)} GiB"


def _inputs() -> list[str]:
    c, w = TPU_V5P.rates()
    p = PREC
    rows = [["$D$ = d_model", _int(XXL.d_model)], ["$F$ = d_ff", _int(XXL.d_ff)], ["$L$ = num_blocks", XXL.num_blocks],
            ["H100 memory", f"{H100_MEMORY_GB} GiB"], ["TPU v5p memory $H$", f"{V5P_MEMORY_GB} GiB"],
            ["$C$ (v5p, BF16)", f"${_tex(c)}$ FLOP/s"],
            ["$W = W_{ici}$ (v5p, one axis, both directions)", f"${_tex(w)}$ bytes/s"],
            ["$X$ (FSDP), $Y$ (TP), $M_X$, $M_Y$", f"{MESH.fsdp}, {MESH.tensor}, {MESH.fsdp_axes}, {MESH.tensor_axes}"],
            ["bytes: master weight, gradient, each Adam moment",
             f"{p.master_weight_bytes}, {p.gradient_bytes}, {p.optimizer_moment_bytes} "
             f"({p.optimizer_moments} moments)"],
            ["bytes: saved activation; communicated weight $c_w$, activation $c_a$",
             f"{p.activation_bytes}; {p.weight_comm_bytes}, {p.activation_comm_bytes}"]]
    return [
        "The handout's inputs, defined once in `cs336_systems/capacity/handout.py`; every number below is computed "
        "from them by `cs336_systems/capacity/` when this page renders:", "",
        fmt.table(["input", "value"], rows, align="ll"), "", "Assumptions:", "",
        "- Sizes in GiB ($2^{30}$ bytes), the unit of this repo and of Google's figure for v5p (95 GiB of HBM per "
        "chip); where the answer changes if \"GB\" means $10^9$ bytes, both are given.",
        f"- Adam keeps two FP32 moments; with the FP32 master weights and accumulated gradients that is "
        f"{state_bytes_per_parameter(PREC)} bytes per parameter. The BF16 working copy of the weights is not counted "
        "(the problem does not ask for it; under FSDP only the block being computed is gathered).",
        "- *Saved for backward* counts, per token, the input of every linear layer: the weight gradient of $y = xW$ "
        r"is $x^\top \partial y$, and with no activation function between the two layers nothing else is needed. "
        "Activations scale with the batch, so they are given per token and for a stated batch (the overall batch "
        "part (c) arrives at).",
        f"- *Half of the activations sharded*: a fraction $f = {SHARDED_ACTIVATIONS}$ of the activations a device "
        "holds is divided over the $N$ FSDP devices, the rest is held whole by each.",
        "- Part (c) times the forward pass only, as the handout asks, with the Scaling Book's cost of a collective "
        "(an all-gather whose result, or a reduce-scatter whose input, holds $V$ bytes takes $V/(W M)$ along $M$ "
        "axes: the ring's factor $(n-1)/n$ is dropped) and with the weights gathered in BF16."]


def _part_a(batch: int) -> list[str]:
    p, s, a = parameter_count(XXL), training_state_bytes(XXL, PREC), saved_activation_bytes_per_token(XXL, PREC)
    acts = saved_activation_bytes(XXL, PREC, batch)
    h100_state, h100_total = devices_worth(s, H100), devices_worth(s + acts, H100)
    decimal = devices_worth(s, decimal_reading(H100, H100_MEMORY_GB))
    q = PREC
    per_parameter = (f"{q.master_weight_bytes} + {q.gradient_bytes} + {q.optimizer_moments} \\cdot "
                     f"{q.optimizer_moment_bytes}")
    return [
        "### (a) Memory on one device", "",
        f"$$P = L \\cdot 2DF = {XXL.num_blocks} \\cdot 2 \\cdot {XXL.d_model} \\cdot {XXL.d_ff} = {_int(p, True)} "
        f"\\approx {_tex(p)} \\text{{ parameters}}$$",
        f"$$S = P\\,({per_parameter}) = {state_bytes_per_parameter(PREC)}P = {_tex(s)} \\text{{ bytes}} = "
        f"{_tex(s / GB, 4)} \\text{{ GiB}}$$",
        f"$$a = L\\,(D + F) \\cdot {q.activation_bytes} = {_int(a, True)} \\text{{ bytes per token}} = "
        f"{_tex(a / MB, 4)} \\text{{ MiB per token}}, \\qquad A(B) = a\\,B$$", "",
        f"For the overall batch of part (c), $B$ = {_int(batch)} tokens, $A$ = {_gib(acts)}. In H100 80GB memories: "
        f"$S$/80 GiB = {fmt.sig(h100_state, 4)}, and {fmt.sig(h100_total, 4)} with those activations.", "",
        f"**Answer:** the FP32 master weights, accumulated gradients and Adam state take {_gib(s)} "
        f"({fmt.sig(s / 1e12, 3)} TB), {math.ceil(h100_state)} H100s' worth ({math.ceil(decimal)} if an H100 held "
        f"$80 \\cdot 10^9$ bytes), and the BF16 activations saved for backward add {fmt.sig(a / MB, 4)} MiB per "
        f"token, {_gib(acts)} for a batch of {_int(batch)} tokens ({math.ceil(h100_total)} H100s in all)."]


def _part_b(batch: int) -> list[str]:
    s, a = training_state_bytes(XXL, PREC), saved_activation_bytes_per_token(XXL, PREC)
    decimal = decimal_reading(TPU_V5P, V5P_MEMORY_GB)
    cases = [(0, "none (state only)"), (batch / MESH.devices, "per device in (c), $B/N$"),
             (batch / MESH.fsdp, "per FSDP shard in (c), $B/X$"), (batch, "all of (c)'s batch")]
    rows = []
    for tokens, what in cases:
        least = [min_fsdp_devices(XXL, PREC, chip, tokens) for chip in (TPU_V5P, decimal)]
        rows.append([fmt.sig(tokens, 4), what, _gib(saved_activation_bytes(XXL, PREC, tokens)),
                     *(n if n else NONE_FITS for n in least)])
    limit = max_tokens_for_any_fsdp(XXL, PREC, TPU_V5P)
    lowest, lowest_decimal = (min_fsdp_devices(XXL, PREC, chip, 0) for chip in (TPU_V5P, decimal))
    per_shard = min_fsdp_devices(XXL, PREC, TPU_V5P, batch / MESH.fsdp)
    block = gathered_block_bytes(XXL, PREC)
    return [
        "### (b) Sharded over $N_{FSDP}$ devices", "",
        f"Weights, gradients and optimizer state are divided by $N$ (ZeRO stage 3, {ZERO}); of the activations $A$ "
        "of the tokens a device holds, half are divided by $N$ and half stay whole:", "",
        r"$$M(N) = \frac{S + A/2}{N} + \frac{A}{2} < H \quad\Longleftrightarrow\quad N > \frac{S + A/2}{H - A/2}"
        r" \quad (\text{possible only while } A/2 < H).$$", "",
        fmt.table(["tokens whose activations a device holds", "which", "$A$", f"least $N$ ({V5P_MEMORY_GB} GiB)",
                   f"least $N$ ({V5P_MEMORY_GB}·10⁹ bytes)"], rows, align="rlrrr"), "",
        f"Beyond {_int(math.floor(limit))} tokens per device the unsharded half alone exceeds {V5P_MEMORY_GB} GiB "
        "and no $N$ fits. Not counted, as the handout's expression does not count it: the BF16 copy of the block "
        f"being computed, $2DF \\cdot {PREC.weight_comm_bytes}$ bytes = {_gib(block, 3)} without tensor parallelism, "
        "twice that while the next block is prefetched.", "",
        f"**Answer:** $M(N) = (S + A/2)/N + A/2$ with $S$ = {_gib(s)} and $A = aB$, $a$ = {fmt.sig(a / MB, 4)} MiB "
        f"per token; it fits in a {V5P_MEMORY_GB} GiB v5p from $N_{{FSDP}}$ = {lowest} when the activations are "
        f"negligible ({lowest_decimal} reading 95GB as $95 \\cdot 10^9$ bytes), and needs more as the tokens per "
        f"device grow ({per_shard} at (c)'s {fmt.sig(batch / MESH.fsdp, 4)} tokens per FSDP shard)."]


def _book_check(serial: float) -> str:
    book_chip = Chip(f"alpha = {BOOK_ALPHA}", 1.0, flops_per_s=float(BOOK_ALPHA), ici_bytes_per_s=1.0)
    book_model = FeedForwardStack(1, BOOK_F, 1)  # D and L cancel out of both results
    low, high = compute_bound_fsdp_range(book_model, book_chip, PREC, BOOK_B, BOOK_N, MESH.fsdp_axes,
                                         MESH.tensor_axes)
    book_floor = best_split_min_tokens_per_device(book_model, book_chip, PREC, MESH.fsdp_axes, MESH.tensor_axes)
    best = best_split_min_tokens_per_device(XXL, TPU_V5P, PREC, MESH.fsdp_axes, MESH.tensor_axes)
    best_x = best_split_fsdp_degree(XXL, TPU_V5P, PREC, MESH.devices, MESH.tensor_axes)
    return (
        f"Checked against {BOOK}: $B/X \\ge \\alpha/M_X$ is its FSDP bound (\"Fully-Sharded Data Parallelism\"), "
        "$Y \\le M_Y F/\\alpha$ its tensor-parallel bound (\"Tensor Parallelism\"), and the serial condition with "
        "$Y = N/X$ is its quadratic in $X$ (\"Mixed FSDP and Tensor Parallelism\"): for its example (a 4×4×4 slice, "
        f"$F$ = {_int(BOOK_F)}, $B$ = {_int(BOOK_B)}, α = {BOOK_ALPHA}) our roots are $X$ = {fmt.sig(low, 3)} and "
        f"{fmt.sig(high, 3)}, the book's $X \\approx 31.7$; minimising over $X$ gives its floor "
        f"$B/N \\ge c_w c_a \\alpha^2/(F M_X M_Y) = 4\\alpha^2/(F M_X M_Y)$ = {fmt.sig(book_floor, 4)} for that $F$ "
        f"(the book: \"around 396\"). For XXL that floor is {fmt.sig(best, 4)} tokens per device at "
        f"$X$ = {fmt.sig(best_x, 3)}; the given $X$ = {MESH.fsdp} is not that split, hence the higher "
        f"{fmt.sig(serial / MESH.devices, 4)}. `tests/test_capacity.py` also finds $B^\\ast$ by scanning batch sizes "
        "with the three times.")


def _part_c(batch: int) -> list[str]:
    n = MESH.devices
    serial, overlapped = (min_compute_bound_tokens(XXL, TPU_V5P, MESH, PREC, o) for o in (False, True))
    times = forward_times(XXL, TPU_V5P, MESH, PREC, batch)
    y_max = max_tensor_degree(XXL, TPU_V5P, PREC, MESH.tensor_axes)
    rows = [["$T_{math}$", fmt.ms(times.math_s, 4)], ["$T_{FSDP}$", fmt.ms(times.fsdp_s, 4)],
            ["$T_{TP}$", fmt.ms(times.tp_s, 4)], ["$T_{FSDP} + T_{TP}$", fmt.ms(times.comm_s(), 4)]]
    return [
        "### (c) When the forward pass is compute-bound", "",
        "Sharding as in the Scaling Book's mixed FSDP and tensor parallelism: $\\text{In}[B_X, D_Y]$, "
        "$W_{in}[D_X, F_Y]$, $W_{out}[F_Y, D_X]$. Per block every device all-gathers its input over $Y$ "
        "(to $[B_X, D]$), all-gathers each weight over $X$ (to $[D, F_Y]$ and $[F_Y, D]$), multiplies, and "
        "reduce-scatters the partial output over $Y$. Each device does $1/N$ of the $4BDF$ FLOPs of a block, "
        f"and with $N = XY$, $c_w = c_a$ = {PREC.weight_comm_bytes} bytes (BF16) and $\\alpha = C/W$ = "
        f"{fmt.sig(TPU_V5P.alpha, 5)} FLOPs per byte, over the $L$ blocks:", "",
        r"$$T_{math} = \frac{4 B D F L}{N C}, \qquad T_{FSDP} = \frac{2 L \cdot c_w\,DF/Y}{W M_X}, \qquad "
        r"T_{TP} = \frac{2 L \cdot c_a\,B D/X}{W M_Y}.$$", "",
        "FSDP moves weights (no $B$), tensor parallelism moves activations (no $F$). Compute-bound means the "
        "collectives, overlapped with the matmuls, take no longer than they do. With the Scaling Book's condition, "
        r"both kinds of collective one after the other, $T_{math} \ge T_{FSDP} + T_{TP}$, which after dividing by "
        "$2DL/W$ is linear in $B$:", "",
        r"$$B \ge B^\ast = \frac{c_w F/(Y M_X)}{2F/(N\alpha) - c_a/(X M_Y)} = "
        f"{fmt.sig(serial, 6)} \\text{{ tokens}}, \\qquad \\frac{{B^\\ast}}{{N}} = {fmt.sig(serial / n, 4)}.$$", "",
        "It exists because tensor parallelism alone is hideable: $T_{math} \\ge T_{TP}$ for every $B$ iff "
        f"$Y \\le 2 F M_Y/(c_a \\alpha)$ = {fmt.sig(y_max, 3)} (here $Y$ = {MESH.tensor}). If the two kinds ran at "
        "the same time on their own links (FSDP's on $X$'s axes, TP's on $Y$'s), only $T_{math} \\ge T_{FSDP}$ "
        f"would bind: $B/X \\ge c_w \\alpha/(2 M_X)$, $B \\ge$ {fmt.sig(overlapped, 6)} "
        f"({fmt.sig(overlapped / n, 4)} per device).", "",
        f"At $B$ = {_int(batch)} tokens (the smallest compute-bound batch with whole tokens on each of the "
        f"{MESH.fsdp} FSDP shards), one forward pass of the model takes (ms):", "", fmt.table(["time", "ms"], rows),
        "", _book_check(serial), "",
        f"**Answer:** the forward pass is compute-bound from {fmt.sig(serial / n, 4)} tokens per device "
        f"($B/N$; {fmt.sig(serial / MESH.fsdp, 5)} per FSDP shard), an overall batch of {_int(math.ceil(serial))} "
        f"tokens ({_int(batch)} to split evenly over the {MESH.fsdp} FSDP shards); if the FSDP and TP collectives "
        f"overlap each other too, from {fmt.sig(overlapped / n, 4)} per device ({_int(math.ceil(overlapped))} "
        "overall)."]


def _tricks(batch: int, floor: dict[str, str]) -> str:
    """Part (d)'s paragraph: each claim tied to a row of the table, an equation of (c) or a reference."""
    times = forward_times(XXL, TPU_V5P, MESH, PREC, batch)
    y_max = max_tensor_degree(XXL, TPU_V5P, PREC, MESH.tensor_axes)
    best = best_split_min_tokens_per_device(XXL, TPU_V5P, PREC, MESH.fsdp_axes, MESH.tensor_axes)
    best_x = best_split_fsdp_degree(XXL, TPU_V5P, PREC, MESH.devices, MESH.tensor_axes)
    more, most, links, pipe = (VARIANT[k] for k in ("more_tp", "most_tp", "more_links", "pipeline"))
    stages, micro = pipe.pipeline_stages, 4 * pipe.pipeline_stages
    pipe_batch = min_compute_bound_tokens(XXL, TPU_V5P, pipe.mesh, pipe.precision)
    resident = (parameter_count(XXL) * PREC.weight_comm_bytes / (stages * pipe.mesh.tensor)
                + training_state_bytes(XXL, PREC) / pipe.devices)
    replicated = gathered_block_bytes(XXL, PREC, MESH.tensor) * XXL.num_blocks
    return " ".join([
        f"The floor is set by $T_{{FSDP}}$, the one term that does not shrink with the batch: at $B$ = {_int(batch)} "
        f"it is {fmt.pct(times.fsdp_s / times.math_s, 3)} of $T_{{math}}$ and $T_{{TP}}$ only "
        f"{fmt.pct(times.tp_s / times.math_s, 3)}, so each trick moves weights less often or faster, or trades "
        "moving weights for moving activations.",
        "Shifting the split towards tensor parallelism does the latter ($T_{FSDP} \\propto 1/Y$, "
        f"$T_{{TP}} \\propto 1/X$), and tensor parallelism stays hideable up to $Y$ = {fmt.sig(y_max, 3)}: "
        f"$X$ = {more.mesh.fsdp}, $Y$ = {more.mesh.tensor} lowers the floor to {floor['more_tp']} tokens per device, "
        f"the best real split ($X$ = {fmt.sig(best_x, 3)}) to {fmt.sig(best, 4)} (the Scaling Book, \"Mixed FSDP "
        f"and Tensor Parallelism\"), and past it $T_{{TP}}$ takes over ({floor['most_tp']} at $X$ = "
        f"{most.mesh.fsdp}, $Y$ = {most.mesh.tensor}); on GPUs the same reasoning keeps tensor parallelism inside "
        f"a node, where NVLink gives it a large $W$ ({MEGATRON}, Sec. 3.3, takeaway 1).",
        "Overlap helps twice: prefetching each block's weight all-gathers and running them beside the TP "
        f"collectives on the other axis's links turns the sum into a max ({floor['overlapped']} per device), and "
        "the TP collectives, which sit on the critical path, are hidden by splitting the matmul into chunks that "
        f"overlap with them (collective matmuls: {COLLECTIVE_MATMUL}).",
        "Fewer bits on the wire: $B^\\ast$ is proportional to $c_w$ (and the best split's floor to $c_w c_a$), so "
        f"8-bit weight all-gathers (the quantized weights of ZeRO++: {ZERO_PP}) give {floor['fp8_weights']} and "
        f"8-bit activations too {floor['fp8_both']}, while the master weights and Adam state stay in FP32, so only "
        "the copies sent for compute are rounded; lowering the *compute* precision instead does not help tensor "
        "parallelism, since $C$ doubles as $c_a$ halves (the Scaling Book, \"Tensor Parallelism\").",
        f"More links per collective divide $T_{{FSDP}}$ by $M_X$ ({floor['more_links']} at $M_X$ = "
        f"{links.mesh.fsdp_axes}).",
        "Pipeline parallelism adds devices along the layers, which leave both conditions unchanged because a "
        f"stage's $T_{{math}}$ and $T_{{comm}}$ both scale with its share of the $L$ blocks: the same "
        f"{MESH.devices} devices as {stages} stages of $X$ = {pipe.mesh.fsdp}, $Y$ = {pipe.mesh.tensor} are "
        f"compute-bound from $B$ = {_int(math.ceil(pipe_batch))} ({floor['pipeline']} per device), provided a "
        "stage gathers its weights once per step rather than once per micro-batch (its BF16 weights and its share "
        f"of the state take {_gib(resident, 3)} per device before activations, under {V5P_MEMORY_GB} GiB), at the "
        f"price of the bubble $(p-1)/m$, {fmt.pct(pipeline_bubble_fraction(stages, micro), 3)} of the step with "
        f"for example $m$ = {micro} micro-batches ({MEGATRON}, Sec. 2.2; interleaved stages shrink it further), "
        f"whose {fmt.sig(pipe_batch / micro, 3)} tokens each make every matmul smaller and less efficient.",
        "What does not help: gradient accumulation (every micro-batch that gathers the weights again must clear "
        "the floor by itself), and ZeRO stage 1 or 2 to skip the forward all-gathers, since the BF16 weights would "
        f"then be held whole along $X$: {_gib(replicated, 3)} per device at $Y$ = {MESH.tensor} ({ZERO})."])


def _part_d(batch: int) -> list[str]:
    base = min_compute_bound_tokens(XXL, TPU_V5P, MESH, PREC)
    floor, rows = {}, []
    for v in VARIANTS:
        tokens = min_compute_bound_tokens(XXL, TPU_V5P, v.mesh, v.precision, v.overlap_collectives)
        floor[v.key] = fmt.sig(tokens / v.devices, 4)
        rows.append([v.name, v.change, floor[v.key], _int(math.ceil(tokens)), fmt.ratio(tokens / base)])
    return ["### (d) Smaller batches that stay compute-bound", "",
            "Each row changes one thing in (c) and solves for the smallest batch again with the same functions "
            f"(`VARIANTS` in `cs336_systems/capacity/handout.py`); $M_X$ = {MESH.fsdp_axes} and $M_Y$ = "
            f"{MESH.tensor_axes} are kept for every split, as the Scaling Book does:", "",
            fmt.table(["variant", "what changes", "least $B/N$ (all devices)", "least $B$ (tokens)", "vs. as given"],
                      rows, align="llrrr"), "", _tricks(batch, floor)]


def communication_accounting_section(ctx: RenderContext) -> Section:
    """The section answering (a)-(d); it reads no results (``ctx`` is unused: nothing here is measured)."""
    batch = smallest_compute_bound_batch(XXL, TPU_V5P, MESH, PREC)
    out = [HEADING, "", *_inputs(), "", *_part_a(batch), "", *_part_b(batch), "", *_part_c(batch), "",
           *_part_d(batch)]
    return Section("\n".join(out))
