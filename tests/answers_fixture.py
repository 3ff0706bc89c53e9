"""The answers (cs336_systems/answers/) as a student's submission, for the grader to grade.

``build_answers_submission(dst)`` lays out the tree a student hands in:

    dst/cs336_systems/__init__.py
    dst/cs336_systems/answers/*.py              copied from this repository, the one copy
    dst/tests/__init__.py, dst/tests/adapters.py  the handout's adapters, importing the answers'
    dst/cs336-basics/cs336_basics/              the course's model (Linear, Embedding, RMSNorm)

so that ``python -m grading dst`` grades the answers as it grades any submission
(``python -m tests.answers_fixture DST`` builds it from the command line): 35/35 for 2026, 28/28
for 2025. It is the grader's correct submission: tests/test_grading*.py, test_course_grading.py
and tests/hostile.py build every tree they grade from it (``tests.test_grading.make_submission``),
and mutate it into wrong ones: ``ANSWER_MUTANTS`` (by name, joined with "+"), ``ANSWER_EDITS``
(test_grading_rubric.py), ``ANSWER_ZERO_INIT`` and ``ANSWER_FILES`` (test_grading_probe_forgeries.py);
``apply_mutant`` and ``apply_edits`` make them. The one copy of the answers is
cs336_systems/answers/; only the course's small model lives beside the tests
(tests/fixtures/cs336-basics/).

Where the answers differ from the student-style fixture the grader's tests used before (the
expectations that changed with the switch):

* "syntax" breaks one problem: the bucketed DDP is another file (reason
  "cs336_systems/answers/ddp_overlap_individual_parameters.py:10: SyntaxError: invalid syntax");
* "import_error": "cs336_systems/answers/sharded_optimizer.py:13: ModuleNotFoundError: ...";
* "refuses_uneven" needs no edit: the answer refuses uneven shards itself ("... 37 rows does not
  divide 3 ranks evenly ..."), a check beyond the handout worth 0, so the answers' 35/35 comes
  with that one failure;
* a submission without an adapters file must also lose cs336_systems/answers/adapters.py, or the
  grader's search for an adapters file finds it;
* the answers free the gathered weights after forward and gather them again in backward, so they
  pass test_gathered_weights_are_freed, now graded; "keeps_gathered" is the mutant that fails it
  (the old fixture's way), and "padded_shards" an equivalent variant that must lose nothing;
* the bytes carried, read from outside the ranks (tests/test_grading_traffic.py):
  "all_reduces_gradients" and "casts_after_gather" carry twice what the answers' FSDP carries in
  backward or forward, "no_prefetch" is an equivalent variant; "zeros_during_backward" (and
  "_bucketed") is issue 38's overlap forgery, which the probe inside the rank does not see.
"""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ANSWERS = REPO / "cs336_systems" / "answers"
# The course's model for FSDP, a small one: only Linear, Embedding and RMSNorm, which is all the
# grader's FSDP tests import.
BASICS = REPO / "tests" / "fixtures" / "cs336-basics" / "cs336_basics"

# The handout's adapter names, both editions (2025: the DDP ones and get_sharded_optimizer; 2026:
# get_ddp, ddp_on_after_backward and the FSDP ones).
HANDOUT_ADAPTERS = ("get_ddp_individual_parameters", "ddp_individual_parameters_on_after_backward", "get_ddp",
                    "ddp_on_after_backward", "get_ddp_bucketed", "ddp_bucketed_on_after_backward",
                    "ddp_bucketed_on_train_batch_start", "get_sharded_optimizer", "get_fsdp", "fsdp_on_after_backward",
                    "fsdp_gather_full_params")


def adapters_text() -> str:
    """tests/adapters.py of the submission: one def per adapter (as the handout's stub has them,
    which the grader's stub mutant relies on), each calling the answers' adapter of that name."""
    defs = [f"def {name}(*args, **kwargs):\n    return answers.{name}(*args, **kwargs)\n" for name in HANDOUT_ADAPTERS]
    return ('"""The handout\'s adapters, bound to the answers (cs336_systems/answers/adapters.py)."""\n\n'
            "from cs336_systems.answers import adapters as answers\n\n\n" + "\n\n".join(defs))


def build_answers_submission(dst: Path) -> Path:
    """Write the answers' submission tree under ``dst`` (created; must not exist) and return it."""
    dst = Path(dst)
    dst.mkdir(parents=True)
    (dst / "cs336_systems").mkdir()
    (dst / "cs336_systems" / "__init__.py").write_text('"""A submission: the answers of CS336 assignment 2."""\n')
    shutil.copytree(ANSWERS, dst / "cs336_systems" / "answers", ignore=shutil.ignore_patterns("__pycache__"))
    (dst / "tests").mkdir()
    (dst / "tests" / "__init__.py").write_text("")
    (dst / "tests" / "adapters.py").write_text(adapters_text())
    shutil.copytree(BASICS, dst / "cs336-basics" / "cs336_basics", ignore=shutil.ignore_patterns("__pycache__"))
    return dst


# What ordinary submissions import (tests/test_grading_fairness.py, make footprint): the course's model
# module's imports (2026 release: a stand-in importing the same libraries at module level, before our
# small model), a module with a torch.compile'd function, and a plotting module.
COURSE_IMPORTS = "import einx  # noqa: F401\nfrom einops import einsum, rearrange  # noqa: F401\n" \
                 "from jaxtyping import Bool, Float, Int  # noqa: F401\n"

COMPILED = '''"""A FlashAttention forward in PyTorch, compiled as the handout asks."""
import math

import torch


@torch.compile
def flash_forward(q, k, v, is_causal: bool = False):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v
'''

PLOTS = '''"""Benchmark plots."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot(xs, ys, path):
    fig, ax = plt.subplots()
    ax.plot(np.asarray(xs), np.asarray(ys))
    fig.savefig(path)
'''



def with_imports(tree: Path, *which: str) -> Path:
    """``tree`` (the answers' submission) whose model module or adapters also import what
    ordinary submissions import: "course" (the course model's libraries), "compile" (a
    ``torch.compile``'d FlashAttention), "plots" (matplotlib and numpy)."""
    if "course" in which:
        model = tree / "cs336-basics" / "cs336_basics" / "model.py"
        model.write_text(COURSE_IMPORTS + model.read_text())
    added = {"compile": ("flash.py", COMPILED, "from cs336_systems.flash import flash_forward  # noqa: F401\n"),
             "plots": ("plots.py", PLOTS, "from cs336_systems.plots import plot  # noqa: F401\n")}
    adapters = tree / "tests" / "adapters.py"
    for name in which:
        if name in added:
            file, text, line = added[name]
            (tree / "cs336_systems" / file).write_text(text)
            adapters.write_text(adapters.read_text().replace(
                "from cs336_systems.answers import adapters as answers\n",
                "from cs336_systems.answers import adapters as answers\n" + line))
    return tree


# The mutants tests/test_grading.py grades, by name: edits (file, old text, new text) of the answers'
# tree, each old text present exactly once.
A = "cs336_systems/answers/"
PER_PARAMETER_FILE, BUCKETED_FILE = A + "ddp_overlap_individual_parameters.py", A + "ddp_bucketed.py"
ZERO_FILE, FSDP_FILE = A + "sharded_optimizer.py", A + "fsdp.py"
ANSWER_MUTANTS: dict[str, list[tuple[str, str, str]]] = {
    # the per-parameter DDP sums instead of averaging
    "sums": [(PER_PARAMETER_FILE, "        param.grad.div_(self.world_size)\n", "")],
    # every rank waits for a message its peer never sends
    "deadlock": [(PER_PARAMETER_FILE, "        for handle in self.handles:\n",
                  "        peer = (dist.get_rank() + 1) % self.world_size\n"
                  "        dist.recv(torch.zeros(1), src=peer)  # every rank waits for its peer: none sends\n"
                  "        for handle in self.handles:\n")],
    # a syntax error at line 8 of the DDP file the 2025 adapters import first (per-parameter)
    "syntax": [(PER_PARAMETER_FILE, "\nimport torch\n", "\ndef broken(:\nimport torch\n")],
    "import_error": [(ZERO_FILE, "import torch\n", "import torch\nimport cs336_systems.helpers\n")],
    # all-reduces issued after backward, in finish_gradient_synchronization
    "no_overlap": [(PER_PARAMETER_FILE,
                    "        self.handles.append(dist.all_reduce(param.grad, async_op=True))\n",
                    "        self.ready.append(param)\n"),
                   (PER_PARAMETER_FILE, "        self.handles: list[dist.Work] = []\n",
                    "        self.handles: list[dist.Work] = []\n        self.ready = []\n"),
                   (PER_PARAMETER_FILE, "        for handle in self.handles:\n",
                    "        for param in self.ready:\n"
                    "            self.handles.append(dist.all_reduce(param.grad, async_op=True))\n"
                    "        self.ready.clear()\n"
                    "        for handle in self.handles:\n")],
    "ignores_bucket_size": [(BUCKETED_FILE, "cap = float(\"inf\") if bucket_size_mb is None else bucket_size_mb * MB",
                             "cap = 0")],
    # every rank steps every parameter (the full state everywhere) and broadcasts nothing
    "full_optimizer_state": [(ZERO_FILE, "if self.owner[p] == self.rank]", "]"),
                             (ZERO_FILE, "            dist.broadcast(param.data, src=owner)\n", "            pass\n")],
    # a full copy of each sharded weight kept beside its shard
    "full_weights": [(FSDP_FILE, "        module.weight = nn.Parameter(shard)  # what named_parameters() and the optimizer now see\n",
                      "        module.weight = nn.Parameter(shard)  # what named_parameters() and the optimizer now see\n"
                      "        module.full_copy = full.clone()\n")],
    # right at 2 ranks, wrong at 3: ranks 0 and 1 broadcast everything
    "two_ranks_only": [(ZERO_FILE, "dist.broadcast(param.data, src=owner)", "dist.broadcast(param.data, src=owner % 2)")],
    # the answer already refuses uneven shards with a clear error, as this mutant of the old fixture did
    "refuses_uneven": [],
    # each rank owns parameters of ranks 0 and 1 only: written for 2 ranks, at 3 rank 2 keeps no state
    "two_ranks_partition": [(ZERO_FILE, "owner = min(range(self.world_size), key=", "owner = min(range(2), key=")],
    "embedding_unsharded": [(FSDP_FILE, "for m in module.modules() if isinstance(m, (Linear, Embedding))]",
                             "for m in module.modules() if isinstance(m, Linear)]")],
    # equivalent: each shard a flat block with 100 elements of padding, cut off after each all-gather
    "padded_shards": [
        (FSDP_FILE, "        shard = full.chunk(world_size)[fsdp.rank].clone()  # a copy: the full weight is freed below\n",
         "        shard = torch.cat([full.chunk(world_size)[fsdp.rank].flatten(), full.new_zeros(PAD)])\n"),
        (FSDP_FILE, "        full = torch.empty(self.full_shape, dtype=shard.dtype, device=shard.device)\n",
         "        full = torch.empty(self.fsdp.world_size * shard.numel(), dtype=shard.dtype, device=shard.device)\n"),
        (FSDP_FILE, "        work.wait()\n        return full\n",
         "        work.wait()\n        return full.view(self.fsdp.world_size, -1)[:, :-PAD].reshape(self.full_shape)\n"),
        (FSDP_FILE, "        grad = grad.to(self.shard.dtype).div(self.fsdp.world_size).contiguous()\n",
         "        grad = grad.to(self.shard.dtype).div(self.fsdp.world_size).reshape(self.fsdp.world_size, -1)\n"
         "        grad = torch.cat([grad, grad.new_zeros(self.fsdp.world_size, PAD)], 1).flatten()  # gloo wants it flat\n"),
        (FSDP_FILE, "                full[name] = torch.empty(layer.full_shape, dtype=param.dtype, device=param.device)\n"
                    "                dist.all_gather_into_tensor(full[name], param.detach().contiguous())\n",
         "                padded = torch.empty(self.world_size * param.numel(), dtype=param.dtype, device=param.device)\n"
         "                dist.all_gather_into_tensor(padded, param.detach().contiguous())\n"
         "                full[name] = padded.view(self.world_size, -1)[:, :-PAD].reshape(layer.full_shape)\n"),
        (FSDP_FILE, "\nclass _Layer:", "\nPAD = 100\n\n\nclass _Layer:")],
    # the gathered weights a matmul saves for backward kept alive from forward to backward (no
    # saved-tensor hooks), so backward does not gather them again
    "keeps_gathered": [(FSDP_FILE, "torch.autograd.graph.saved_tensors_hooks(self._pack_for(layer), self._unpack_for(layer))",
                        "torch.autograd.graph.saved_tensors_hooks(lambda saved: saved, lambda saved: saved)")],
    # the full gradient all-reduced on every rank, each keeping its own rows: right values, twice the bytes
    "all_reduces_gradients": [(FSDP_FILE, "        out = torch.empty_like(self.shard)\n"
                                          "        self.fsdp.pending.append((self, out, dist.reduce_scatter_tensor(out, grad, async_op=True)))\n",
                               "        out = grad.chunk(self.fsdp.world_size)[self.fsdp.rank]  # filled by the all-reduce\n"
                               "        self.fsdp.pending.append((self, out, dist.all_reduce(grad, async_op=True)))\n")],
    # the float32 shard all-gathered, the full weight cast to the compute dtype after: right values, twice the bytes
    "casts_after_gather": [(FSDP_FILE, "shard = self.shard.detach().to(self.fsdp.compute_dtype or self.shard.dtype)",
                            "shard = self.shard.detach()"),
                           (FSDP_FILE, "        work.wait()\n        return full\n",
                            "        work.wait()\n        return full.to(self.fsdp.compute_dtype or full.dtype)\n")],
    # the suite's holds patched away in the rank (it runs beside the suite's code): no phase can be attributed
    "skips_holds": [(FSDP_FILE, "\nclass _Layer:", "\nimport grading.readings.traffic\n\ngrading.readings.traffic.hold = lambda *args: b\"\"\n\n\n"
                                                  "class _Layer:")],
    # a child process that wakes its rank (SIGCONT) every millisecond (a stopped rank's own threads
    # cannot): no hold can be read as the group's
    "wakes_itself": [(FSDP_FILE, "\nclass _Layer:",
                      "\nimport os, signal, time\n\n_RANK = os.getpid()\nif os.fork() == 0:\n    while True:\n"
                      "        time.sleep(0.001)\n        try:\n            os.kill(_RANK, signal.SIGCONT)\n"
                      "        except ProcessLookupError:\n            os._exit(0)\n\n\nclass _Layer:")],
    # equivalent: no prefetch, each layer gathered when its forward starts
    "no_prefetch": [(FSDP_FILE, "        if following is not None and following.prefetched is None:\n",
                     "        if False:\n")],
    # the forgery of issue 38: an asynchronous all-reduce of zeros as large as each gradient during
    # backward (the probe inside the rank sees the right sizes, pending), the real average one
    # blocking flat all-reduce after backward
    "zeros_during_backward": [
        (PER_PARAMETER_FILE, "        self.handles.append(dist.all_reduce(param.grad, async_op=True))\n",
         "        self.handles.append(dist.all_reduce(torch.zeros_like(param.grad), async_op=True))\n"),
        (PER_PARAMETER_FILE, "        self.handles.clear()\n",
         "        self.handles.clear()\n"
         "        grads = [p.grad for p in self.module.parameters() if p.grad is not None]\n"
         "        flat = torch._utils._flatten_dense_tensors(grads)\n"
         "        dist.all_reduce(flat)  # the real average: one blocking all-reduce after backward\n"
         "        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):\n"
         "            grad.copy_(synced)\n")],
    "zeros_during_backward_bucketed": [
        (BUCKETED_FILE, "            self.in_flight[i] = (flat, dist.all_reduce(flat, async_op=True))\n",
         "            self.in_flight[i] = (flat, dist.all_reduce(torch.zeros_like(flat), async_op=True))\n"),
        (BUCKETED_FILE, "        for bucket, (flat, _) in zip(self.buckets, self.in_flight):\n",
         "        flats = [flat for flat, _ in self.in_flight]\n"
         "        every = _flatten_dense_tensors(flats)\n"
         "        dist.all_reduce(every)  # the real average: one blocking all-reduce after backward\n"
         "        for flat, synced in zip(flats, _unflatten_dense_tensors(every, flats)):\n"
         "            flat.copy_(synced)\n"
         "        for bucket, (flat, _) in zip(self.buckets, self.in_flight):\n")],
    "reseeds": [(PER_PARAMETER_FILE,
                 "        for tensor in module.state_dict().values():\n            dist.broadcast(tensor, src=0)\n",
                 "        torch.manual_seed(0)  # the same weights everywhere, without communicating\n"
                 "        for m in module.modules():\n"
                 "            if hasattr(m, 'reset_parameters'):\n"
                 "                m.reset_parameters()\n")],
}


# The edits tests/test_grading_rubric.py grades, several in one submission (different problems' files).
ANSWER_EDITS: dict[str, list[tuple[str, str, str]]] = {
    "blocking_hook": [(PER_PARAMETER_FILE, "        self.handles.append(dist.all_reduce(param.grad, async_op=True))\n",
                       "        dist.all_reduce(param.grad)  # waits for every rank inside backward\n")],
    "skips_averaging": [(PER_PARAMETER_FILE, "        param.grad.div_(self.world_size)\n", ""),
                        (PER_PARAMETER_FILE, "        self.handles.append(dist.all_reduce(param.grad, async_op=True))\n",
                         "        pass  # each rank keeps its own gradient\n")],
    # the shard's group loses its options (lr, weight_decay): also drop step()'s copy of them
    "wrong_group_options": [(ZERO_FILE, 'mine = {**group, "params":', 'mine = {"params":'),
                            (ZERO_FILE, '            mine.update({key: value for key, value in group.items() if key != "params"})\n',
                             "            pass\n")],
    "no_add_param_group": [(ZERO_FILE, "    def add_param_group(self, param_group: dict[str, Any]) -> None:",
                            "    def _assign(self, param_group: dict[str, Any]) -> None:"),
                           (ZERO_FILE, "        super().__init__(params, kwargs)\n",
                            "        super().__init__(params, kwargs)\n"
                            "        groups, self.param_groups = self.param_groups, []\n"
                            "        for group in groups:  # assigned at construction only\n"
                            "            self._assign(group)\n")],
    "no_state_sharding": ANSWER_MUTANTS["full_optimizer_state"],
    "ignores_compute_dtype": [(FSDP_FILE, "shard = self.shard.detach().to(self.fsdp.compute_dtype or self.shard.dtype)",
                               "shard = self.shard.detach()")],
    "full_weights_and_sums": ANSWER_MUTANTS["full_weights"] + [
        (FSDP_FILE, "grad = grad.to(self.shard.dtype).div(self.fsdp.world_size).contiguous()",
         "grad = grad.to(self.shard.dtype).contiguous()")],
}

# tests/test_grading_probe_forgeries.py's zero-initialised forgery: zero-initialised layers and an FSDP that sends
# nothing (each rank's own shard in every place, its own rows of each gradient, no all-reduce).
_DONE = "done = torch.futures.Future()\n        done.set_result(None)\n        "
ANSWER_ZERO_INIT: list[tuple[str, str, str]] = [
    ("cs336-basics/cs336_basics/model.py", "nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)",
     "nn.init.zeros_(self.weight)"),
    ("cs336-basics/cs336_basics/model.py", "nn.init.trunc_normal_(self.weight, std=1.0, a=-3.0, b=3.0)",
     "nn.init.zeros_(self.weight)"),
    (FSDP_FILE, "        for tensor in module.state_dict().values():\n            dist.broadcast(tensor, src=0)\n", ""),
    (FSDP_FILE, "        return full, dist.all_gather_into_tensor(full, shard.contiguous(), async_op=True)\n",
     "        full.view(self.fsdp.world_size, -1).copy_(shard.reshape(1, -1))  # its own shard in every place\n"
     "        " + _DONE + "return full, done\n"),
    (FSDP_FILE, "        self.fsdp.pending.append((self, out, dist.reduce_scatter_tensor(out, grad, async_op=True)))\n",
     "        out.copy_(grad.chunk(self.fsdp.world_size)[self.fsdp.rank])\n"
     "        " + _DONE + "self.fsdp.pending.append((self, out, done))\n"),
    (FSDP_FILE, "        self.replicated_handles.append(dist.all_reduce(param.grad, async_op=True))\n", ""),
    (FSDP_FILE, "                dist.all_gather_into_tensor(full[name], param.detach().contiguous())\n",
     "                full[name].view(self.world_size, -1).copy_(param.detach().reshape(1, -1))\n"),
]
# Whole files the probe forgeries write, by the name they give a file -> the answers' paths it
# replaces: DUMMY_OVERLAP defines both DDP classes, so it replaces both answers' DDP files.
ANSWER_FILES = {
    "cs336_systems/ddp.py": (PER_PARAMETER_FILE, BUCKETED_FILE),
    "cs336_systems/sharded_optimizer.py": (ZERO_FILE,),
    "cs336_systems/fsdp.py": (FSDP_FILE,),
}


def apply_edits(tree: Path, name: str, edits: list[tuple[str, str, str]]) -> Path:
    """Make ``edits`` (file, old text, new text: each old text present exactly once) in ``tree``."""
    for file, old, new in edits:
        text = (tree / file).read_text()
        if text.count(old) != 1:
            raise AssertionError(f"{name}: {old!r} is in {file} {text.count(old)} times, not once")
        (tree / file).write_text(text.replace(old, new))
    return tree


def apply_mutant(tree: Path, mutant: str) -> Path:
    """Make one of ANSWER_MUTANTS' edits in a tree built by build_answers_submission."""
    return apply_edits(tree, mutant, ANSWER_MUTANTS[mutant])


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 2:
        sys.exit("usage: python -m tests.answers_fixture DST [course] [compile] [plots]  (DST must not exist)")
    print(with_imports(build_answers_submission(Path(sys.argv[1])), *sys.argv[2:]))
