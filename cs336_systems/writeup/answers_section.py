"""From the answer to the library: what ddp/, zero/ and fsdp/ add to cs336_systems/answers/.

Each row is a situation torch's DDP, ZeRO or FSDP handles and the handout's answer does not; its
test (tests/answer_vs_library.py, run by tests/test_answer_vs_library.py) fails on the answer and
passes on the library. The lines each costs are counted here from the source at render time (a
function's or class's lines, or a whole file's), so the page cannot drift from the code; the test
counts them again. The step times come from ``answers_step.json`` where a machine has one.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from cs336_systems.bench.answers.record import AnswersStepRecord
from cs336_systems.writeup import fmt, templating
from cs336_systems.writeup.context import Page, RenderContext

REPO = Path(__file__).resolve().parents[2]
ANSWERS = ("naive_ddp", "ddp_overlap_individual_parameters", "ddp_bucketed", "sharded_optimizer", "fsdp")
LIBRARY = {"naive_ddp": ("ddp/naive.py", "ddp/base.py", "ddp/mean_all_reduce.py"),
           "ddp_overlap_individual_parameters": ("ddp/per_parameter.py", "ddp/overlap.py", "ddp/base.py",
                                                 "ddp/mean_all_reduce.py"),
           "ddp_bucketed": ("ddp/bucketed.py", "ddp/bucket.py", "ddp/overlap.py", "ddp/base.py",
                            "ddp/mean_all_reduce.py"),
           "sharded_optimizer": ("zero/optimizer.py", "zero/broadcast.py", "zero/assignment.py", "zero/checkpoint.py"),
           "fsdp": ("fsdp/wrapper.py", "fsdp/schedule.py", "fsdp/reduction.py", "fsdp/sharded_weight.py",
                    "fsdp/unit.py", "fsdp/options.py", "fsdp/checkpoint.py", "fsdp/exact.py", "fsdp/activation_checkpointing.py")}


@dataclass(frozen=True)
class Row:
    name: str  # the check's function in tests/answer_vs_library.py
    situation: str
    answer: str  # what the answer does there
    where: tuple[str, ...]  # the library code that handles it: "path" or "path:Qual.name" under cs336_systems/


ROWS = (
    Row("unused_parameter", "a layer forward never calls (torch: `find_unused_parameters=True`)",
        "its bucket never fills; `finish_gradient_synchronization` raises on every rank",
        ("ddp/base.py:UsageCount", "ddp/base.py:DataParallel._missing_grads", "ddp/bucket.py:GradBucket.missing_usage",
         "ddp/bucket.py:GradBucket.write_grads", "ddp/bucket.py:write_reduced_grads", "ddp/bucket.py:read_together")),
    Row("batchnorm_buffers", "BatchNorm running statistics from each rank's own data (torch: `broadcast_buffers`)",
        "broadcasts buffers once, at construction: the replicas' statistics drift apart",
        ("ddp/base.py:DataParallel.forward", "ddp/base.py:DataParallel._broadcast_buffers")),
    Row("no_sync_accumulation", "gradient accumulation under `no_sync()`, one reduction per step",
        "has no `no_sync()`: every micro-batch all-reduces every gradient",
        ("ddp/base.py:DataParallel.no_sync",)),
    Row("gradient_views", "each `.grad` a view into its bucket (torch: `gradient_as_bucket_view=True`)",
        "copies each bucket out and back: gradients held twice while a bucket is reduced",
        ("ddp/bucket.py:GradBucket.__init__", "ddp/bucket.py:GradBucket._is_view", "ddp/bucket.py:GradBucket.pack")),
    Row("backward_order", "a model whose backward order differs from registration (torch rebuilds buckets after step 1)",
        "buckets follow registration: the first one fills only halfway through backward",
        ("ddp/overlap.py:OverlappedDataParallel._adopt_rank0_ready_order",
         "ddp/overlap.py:OverlappedDataParallel.rebuild_units")),
    Row("optimizer_checkpoint", "saving and resuming the sharded optimizer (`state_dict`, `load_state_dict`)",
        "`state_dict()` is the base class's, empty: a resume restarts AdamW's moments",
        ("zero/checkpoint.py", "zero/optimizer.py:ShardedOptimizer.state_dict",
         "zero/optimizer.py:ShardedOptimizer.load_state_dict")),
    Row("uneven_shards", "weights whose rows the world size does not divide (vocabulary 13 on 3 ranks)",
        "refuses them with a ValueError (equal row blocks only)",
        ("fsdp/sharded_weight.py:ShardLayout",)),
    Row("tied_weights", "an LM head tied to the embedding: one parameter in two sharded layers",
        "shards each layer's copy apart: the tie is broken and training differs",
        ("fsdp/sharded_weight.py:ShardedWeight.add_grad", "fsdp/unit.py:build_units")),
    Row("full_state_dict", "a whole-model checkpoint through torch's `get_model_state_dict`",
        "the state dict holds this rank's shard, not the full weight",
        ("fsdp/checkpoint.py",)),
    Row("reduce_dtype", "gradients reduced in bfloat16, masters float32 (torch: `MixedPrecisionPolicy(reduce_dtype)`)",
        "always reduce-scatters in float32; no `reduce_dtype`",
        ("fsdp/options.py:FsdpOptions", "fsdp/sharded_weight.py:ShardedWeight.reduce_scatter")),
)


def lines_of(path: Path, qualname: str | None = None) -> int:
    """Lines of a function or class (decorators and docstring included), or of the whole file."""
    source = path.read_text()
    if qualname is None:
        return len(source.splitlines())
    body, node = ast.parse(source).body, None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            raise ValueError(f"{path} has no {qualname}")
        body = node.body
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return node.end_lineno - first + 1


def _place(where: str) -> tuple[str, int]:
    path, _, qualname = where.partition(":")
    lines = lines_of(REPO / "cs336_systems" / path, qualname or None)
    return f"`cs336_systems/{where}` ({lines})", lines


def answers_page(ctx: RenderContext) -> Page:
    sizes = [[f"`cs336_systems/answers/{name}.py`", lines_of(REPO / "cs336_systems" / "answers" / f"{name}.py"),
              ", ".join(f"`{p}`" for p in LIBRARY[name]),
              sum(lines_of(REPO / "cs336_systems" / p) for p in LIBRARY[name])] for name in ANSWERS]
    rows = []
    for row in ROWS:
        places = [_place(w) for w in row.where]
        rows.append([f"`{row.name}`", row.situation, row.answer, "; ".join(p for p, _ in places),
                     sum(n for _, n in places)])
    steps = [dict(tag=machine.tag, table=_step_table(results), resolved=_resolved(results),
                  unfit=fmt.not_evidence(results.environment), setting=fmt.setting_line(
        results.environment, results.source, parts=[f"backend {results.environment.backend}",
                                                    f"world size {results.environment.world_size}"]))
             for machine, results in ctx.inputs.runs(AnswersStepRecord.KIND)]
    markdown = templating.render(
        "details/from_answer_to_library.md.j2",
        sizes=fmt.table(["answer", "lines", "the library's files for it", "their lines"], sizes, align="lrlr"),
        rows=fmt.table(["row (test)", "situation", "the answer", "the library's code that handles it (lines)", "lines"],
                       rows, align="llllr"),
        steps=steps)
    return Page("from_answer_to_library", markdown)


def _resolved(results) -> list[str]:
    """The rows whose difference from the library's step excludes zero, as "technique implementation"."""
    return [f"{r.technique}: {r.implementation} − library" for r in results.records
            if not fmt.not_evidence(results.environment) and r.vs_library_ci95_s and not r.vs_library_ci95_s[0] <= 0 <= r.vs_library_ci95_s[1]]


def _step_table(results) -> str:
    """One row per (technique, implementation); the difference from the library is per round, paired."""
    resolved = _resolved(results)

    def vs(r) -> str:
        if r.vs_library_s is None:
            return "–"
        verdict = " *" if f"{r.technique}: {r.implementation} − library" in resolved else ""
        return f"{fmt.ms(r.vs_library_s)} ({fmt.ms_interval(r.vs_library_ci95_s)}){verdict}"

    return fmt.table(["technique", "implementation", "median step (ms)", "95% interval", "minus the library's (ms, 95%)",
                      "rounds"],
                     [[r.technique, r.implementation, fmt.ms(r.median_step_s), fmt.ms_interval(r.median_ci95_s), vs(r),
                       len(r.step_times_s)] for r in results.records], align="llrrrr")
