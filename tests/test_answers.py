"""The answers (cs336_systems/answers/) as the handout's tests and the grader meet them.

* the switch: ``CS336_IMPL=answers`` makes adapters.py (and so tests/adapters.py) call the answers;
* the public test files of each edition pass on the answers, run unchanged in a subprocess
  (tests/public_suite.py; skipped, saying how to enable it, where the course's files are absent);
* the answers stay what the handout asks: one file each, importing only torch (FSDP also
  cs336_basics), within the lengths agreed for a readable answer;
* the submission tree tests/answers_fixture.py builds for the grader, and the mutant edits the
  grader's tests make of it, each of which must still apply exactly once.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.answers_fixture import (
    ANSWER_EDITS,
    ANSWER_MUTANTS,
    ANSWER_ZERO_INIT,
    HANDOUT_ADAPTERS,
    apply_edits,
    build_answers_submission,
)
from tests.public_suite import PUBLIC_FILES, public_tests_folder, run_public_suite

pytestmark = pytest.mark.problem("beyond")

REPO = Path(__file__).resolve().parent.parent
ANSWERS = REPO / "cs336_systems" / "answers"
# Longest a file may grow: about 1.5x the best public student answers' length (issue 42).
MAX_LINES = {"naive_ddp.py": 60, "ddp_overlap_individual_parameters.py": 65, "ddp_bucketed.py": 170,
             "sharded_optimizer.py": 60, "fsdp.py": 330}


def test_the_switch_picks_the_answers_or_the_library():
    """One interpreter (torch imported once), the adapters imported again under each setting."""
    code = ("import importlib, os\n"
            "for impl in ('answers', 'library', 'answer'):\n"
            "    os.environ['CS336_IMPL'] = impl\n"
            "    try:\n"
            "        import adapters, tests.adapters as t\n"
            "        adapters, t = importlib.reload(adapters), importlib.reload(t)\n"
            "        print(impl, sorted({getattr(adapters, n).__module__ for n in %r}), t.get_fsdp is adapters.get_fsdp)\n"
            "    except ValueError as e:\n"
            "        print(impl, e)\n" % (HANDOUT_ADAPTERS,))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.stdout.strip().splitlines() == [
        "answers ['cs336_systems.answers.adapters'] True", "library ['adapters'] True",
        "answer CS336_IMPL must be one of ('library', 'answers'), got 'answer'"], done.stdout + done.stderr


@pytest.mark.timeout(900)
@pytest.mark.parametrize("edition", sorted(PUBLIC_FILES))
def test_public_test_files_pass_on_the_answers(edition):
    folder = public_tests_folder(edition)
    if folder is None:
        pytest.skip(f"the course's {edition} test files are not here: set CS336_PUBLIC_TESTS_{edition} to a checkout "
                    "of the handout's repository (tests/public_suite.py)")
    done = run_public_suite(edition, "answers", folder, ["-n", "0"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout.splitlines()[-1]


@pytest.mark.parametrize("name", sorted(MAX_LINES))
def test_each_answer_is_one_readable_file_importing_only_torch(name):
    source = (ANSWERS / name).read_text()
    assert len(source.splitlines()) <= MAX_LINES[name], f"{name}: {len(source.splitlines())} lines"
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    allowed = {"torch", "typing", "__future__"} | ({"cs336_basics"} if name == "fsdp.py" else set())
    assert imported <= allowed, f"{name} imports {sorted(imported - allowed)}"


def test_the_submission_tree_holds_the_answers_and_every_adapter(tmp_path):
    tree = build_answers_submission(tmp_path / "answers")
    for name in MAX_LINES:
        assert (tree / "cs336_systems" / "answers" / name).read_text() == (ANSWERS / name).read_text()
    adapters = ast.parse((tree / "tests" / "adapters.py").read_text())
    assert [f.name for f in adapters.body if isinstance(f, ast.FunctionDef)] == list(HANDOUT_ADAPTERS)
    assert (tree / "cs336-basics" / "cs336_basics" / "model.py").is_file()
    code = ("import tests.adapters as a, cs336_systems.answers.fsdp, cs336_systems.answers.ddp_bucketed; "
            "print(a.get_ddp.__module__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{tree}:{tree / 'cs336-basics'}"})
    assert done.stdout.strip() == "tests.adapters", done.stderr


@pytest.mark.parametrize("name, edits", [*ANSWER_MUTANTS.items(), *ANSWER_EDITS.items(), ("zero_init", ANSWER_ZERO_INIT)])
def test_every_mapped_mutant_still_applies_and_parses(tmp_path, name, edits):
    """The grader's tests will mutate the answers with these edits: each old text must be in
    its file exactly once, and the result must parse (but the syntax-error mutant)."""
    tree = apply_edits(build_answers_submission(tmp_path / name), name, edits)
    for path in (tree / "cs336_systems" / "answers").glob("*.py"):
        if name == "syntax" and path.name == "ddp_overlap_individual_parameters.py":
            with pytest.raises(SyntaxError):
                ast.parse(path.read_text())
        else:
            ast.parse(path.read_text())


@pytest.mark.timeout(300)
def test_the_step_benchmark_times_every_technique_three_ways(tmp_path):
    """One round of the tiny LM (make bench runs 8 of cpu-small) through the script: a record per
    (technique, implementation), each but the library's paired with the library's, read back
    from answers_step.json."""
    from cs336_systems.bench.answers import AnswersStepRecord
    from cs336_systems.bench.answers.run import IMPLEMENTATIONS, TECHNIQUES
    from cs336_systems.results.kinds import read_any

    out = tmp_path / "answers_step.json"
    done = subprocess.run([sys.executable, "scripts/bench_answers.py", "--model-size", "tiny", "--context-length", "16",
                           "--rounds", "1", "--warmup-steps", "0", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    results = read_any(out)
    assert results.kind == AnswersStepRecord.KIND
    records = results.records
    assert [(r.technique, r.implementation) for r in records] == [(t, i) for t in TECHNIQUES for i in IMPLEMENTATIONS]
    for r in records:
        assert len(r.step_times_s) == 1 and r.median_step_s > 0
        assert (r.vs_library_s is None) == (r.implementation == "library")


def _fsdp_collectives(ctx) -> dict:
    """Rank function: the answer's all-gathers in forward and in backward, and what it holds after."""
    import torch
    import torch.distributed as dist

    from cs336_systems.answers.fsdp import FSDP
    from tests.answer_vs_library import LM

    model = FSDP(LM())  # vocabulary 12, d_model 6, d_ff 12: every weight's rows divide 2 ranks
    gathered: list[str] = []
    original = dist.all_gather_into_tensor

    def all_gather(out, shard, *args, **kwargs):
        gathered.append("backward" if phase == ["backward"] else "forward")
        return original(out, shard, *args, **kwargs)

    phase = ["forward"]
    dist.all_gather_into_tensor = all_gather
    try:
        ids = torch.randint(0, 12, (2, 5), generator=torch.Generator().manual_seed(ctx.rank))
        out = model(ids)
        phase[0] = "backward"
        out.float().pow(2).mean().backward()
    finally:
        dist.all_gather_into_tensor = original
    model.finish_gradient_synchronization()
    shards = {n: (tuple(p.shape), tuple(p.grad.shape), str(p.grad.dtype)) for n, p in model.module.named_parameters()}
    return {"forward": gathered.count("forward"), "backward": gathered.count("backward"), "shards": shards,
            "weights_left": [n for n, m in model.module.named_modules() if "weight" in m.__dict__]}


@pytest.mark.timeout(120)
def test_the_fsdp_answer_gathers_for_forward_and_again_for_backward_and_keeps_only_shards():
    """The handout's FSDP, observed: each of the 4 sharded layers is all-gathered once in forward;
    the 3 Linears again in backward (their input gradients need the weight; the Embedding's does
    not), so no full weight is kept from forward to backward; between steps each rank holds its
    half of every Linear/Embedding weight, with a float32 gradient of the same shape."""
    from tests.rank_pool import on_pool

    for rank, seen in enumerate(on_pool(_fsdp_collectives, 2)):
        assert (seen["forward"], seen["backward"]) == (4, 3), f"rank {rank}: {seen}"
        assert seen["weights_left"] == [], f"rank {rank}: gathered weights still attached to {seen['weights_left']}"
        assert seen["shards"]["embedding.weight"] == ((6, 6), (6, 6), "torch.float32")
        assert seen["shards"]["down.weight"] == ((3, 12), (3, 12), "torch.float32")
        assert seen["shards"]["norm.gain"] == ((6,), (6,), "torch.float32")  # replicated
