"""Problem 2: naive DDP trains to the weights of single-process training (``naive_ddp.json``)."""

from __future__ import annotations

import torch

from cs336_systems.bench.equivalence import LEARNING_RATE, EquivalenceRecord, toy_model
from cs336_systems.writeup import fmt
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import CPU

KIND = EquivalenceRecord.KIND
HEADERS = ["variant", "ranks", "steps", "global batch", "max |DDP − single| over all steps", "after the last step",
           "atol", "ranks bitwise identical", "verdict"]


def _row(r: EquivalenceRecord) -> list:
    per_step = r.max_abs_diff_per_step
    return [r.variant, r.world_size, r.steps, r.global_batch, fmt.sig(r.max_abs_diff),
            fmt.sig(per_step[-1]) if per_step else "–", f"{r.atol:g}", "yes" if r.ranks_identical else "no",
            "**match**" if r.match else "**MISMATCH**"]


def _sentence(r: EquivalenceRecord) -> str:
    verdict = "within" if r.max_abs_diff <= r.atol else "outside"
    return (f"After {r.steps} steps on {r.world_size} ranks, {r.variant} DDP's parameters differ from single-process "
            f"training by at most {fmt.sig(r.max_abs_diff)}, {verdict} the tolerance {r.atol:g}; the ranks' "
            "parameters are " + ("bitwise identical." if r.ranks_identical else "**not** identical."))


def _toy_model_text() -> str:
    """What was trained: the toy model's layers and size, the optimizer, the loss."""
    model = toy_model()
    layers = " → ".join(type(m).__name__ + (f"({m.in_features}, {m.out_features})" if hasattr(m, "in_features") else "")
                        for m in model)
    n = sum(p.numel() for p in model.parameters())
    return (f"The toy model is {layers} ({n:,} parameters), trained with SGD at learning rate {LEARNING_RATE:g} on a "
            "mean squared error against random targets; each step's batch is split into one contiguous shard per rank.")


def _why_not_zero() -> str:
    """Why DDP and single-process training differ by rounding only, and why the ranks agree exactly."""
    rounding = torch.finfo(torch.float32).eps / 2
    return (f"Why the difference is not exactly zero: DDP averages the gradients of the ranks' shards, single-process "
            f"training takes the gradient of the whole batch; these are the same sums taken in a different order, and "
            f"float32 addition rounds each partial sum (to within {fmt.sig(rounding)} of it, relative), so the results "
            "agree to rounding, not bit for bit. The ranks agree exactly because every rank receives the same reduced "
            "sum from the all-reduce and applies the same update to the same weights.")


def naive_ddp_section(ctx: RenderContext) -> Section:
    out = ["## naive_ddp: naive DDP against single-process training", "",
           "The same toy model, trained with naive DDP (gradients averaged by one all-reduce per parameter) "
           "and in one process on the whole batch, from the same initial weights and data; the table shows the "
           "largest absolute difference between any pair of corresponding parameters. " + _toy_model_text()]
    runs = ctx.inputs.runs(KIND)
    for machine, results in runs:
        env = results.environment
        parts = [f"backend {env.backend}", f"world size {env.world_size}"]
        records: list[EquivalenceRecord] = results.records
        out += ["", fmt.run_heading(machine, results), "", fmt.setting_line(env, results.source, parts=parts), "",
                fmt.table(HEADERS, [_row(r) for r in records], align="lrrrrrrll"), "",
                " ".join(_sentence(r) for r in records)]
        if any(r.max_abs_diff > 0 for r in records):
            out += ["", _why_not_zero()]
    if not runs:
        out += ["", f"- Not measured here; `{CPU.command}` ({CPU.where}) fills it."]
    return Section("\n".join(out))
