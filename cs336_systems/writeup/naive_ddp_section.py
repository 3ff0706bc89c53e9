"""Problem naive_ddp: naive DDP trains to the weights of single-process training (``naive_ddp.json``).

Python computes; the words are in ``templates/answers/naive_ddp.md.j2`` and
``templates/details/naive_ddp.md.j2``.
"""

from __future__ import annotations

import torch

from cs336_systems.bench.equivalence import LEARNING_RATE, EquivalenceRecord, toy_model
from cs336_systems.writeup import fmt, templating
from cs336_systems.writeup.context import Page, RenderContext, details_link
from cs336_systems.writeup.coverage import note_gaps

KIND = EquivalenceRecord.KIND
HEADERS = ["variant", "ranks", "steps", "global batch", "max |DDP − single| over all steps", "after the last step",
           "atol", "ranks bitwise identical", "verdict"]


def _row(r: EquivalenceRecord) -> list:
    per_step = r.max_abs_diff_per_step
    return [r.variant, r.world_size, r.steps, r.global_batch, fmt.sig(r.max_abs_diff),
            fmt.sig(per_step[-1]) if per_step else "–", f"{r.atol:g}", "yes" if r.ranks_identical else "no",
            "**match**" if r.match else "**MISMATCH**"]


def naive_ddp_page(ctx: RenderContext) -> Page:
    model = toy_model()
    layers = [type(m).__name__ + (f"({m.in_features}, {m.out_features})" if hasattr(m, "in_features") else "")
              for m in model]
    runs = [dict(tag=machine.tag, records=results.records, table=fmt.table(HEADERS, map(_row, results.records),
                                                                             align="lrrrrrrll"),
                 setting=fmt.setting_line(results.environment, results.source,
                                          parts=[f"backend {results.environment.backend}",
                                                 f"world size {results.environment.world_size}"]))
            for machine, results in ctx.inputs.runs(KIND)]
    note_gaps(ctx, KIND, "naive DDP against single-process training")
    values = dict(runs=runs, layers=" → ".join(layers), parameters=sum(p.numel() for p in model.parameters()),
                  lr=LEARNING_RATE, rounding=torch.finfo(torch.float32).eps / 2, details=details_link("naive_ddp"))
    return Page("naive_ddp", templating.render("details/naive_ddp.md.j2", **values),
                {"naive_ddp": templating.render("answers/naive_ddp.md.j2", **values)})
