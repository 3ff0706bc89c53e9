"""Submissions that fool what a rank measures, graded as tests/test_grading_forgeries.py grades
its forgeries: each must get what its code deserves.

* An "FSDP" that never communicates, over a ``cs336_basics`` whose layers start at zero: every
  gradient is zero from zero weights, so a reference started from the weights a rank reports
  would never move. The grader chooses the weights and fills the model before it is wrapped:
  0 points.
* A sharded optimizer that keeps the full state of every parameter on every rank in a
  module-level global, out of reach of the optimizer object: the rank's resident memory, read
  from outside it, counts it wherever it is kept, so the state is not sharded, and the problem
  is capped at a third.
* DDP that all-reduces every gradient in one flat tensor after backward, and issues a 1-element
  all-reduce per gradient during backward: the probes record the bytes each carried, so
  neither the overlap nor the bucket count is met by the dummies, and both problems are capped.
"""

from __future__ import annotations

import pytest

from grading.harness import grade
from grading.problems import named_for
from tests.answers_fixture import ANSWER_FILES, ANSWER_ZERO_INIT, apply_edits
from tests.test_grading import BUCKETED, FSDP, PER_PARAMETER, QUICK, ZERO, failures, make_submission, points

pytestmark = pytest.mark.problem("beyond")

GLOBAL_STATE = '''"""Every rank keeps the full optimizer in a global the optimizer object never references."""

import torch

_INNER = {}


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs
        super().__init__(params, kwargs)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = {**self.param_groups[-1]}
        if id(self) in _INNER:
            _INNER[id(self)].add_param_group(group)
        else:
            _INNER[id(self)] = self.optimizer_cls([group], **self.kwargs)

    def step(self, closure=None, **kwargs):
        return _INNER[id(self)].step(closure, **kwargs)
'''

DUMMY_OVERLAP = '''"""One flat all-reduce after backward; a 1-element all-reduce per gradient during backward."""

import torch
import torch.distributed as dist
from torch import nn


class _Flat(nn.Module):
    def __init__(self, module: nn.Module, bucket_size_mb: float | None = None):
        super().__init__()
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)
        self.dummies = []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._dummy)

    def _dummy(self, p: nn.Parameter) -> None:
        self.dummies.append(dist.all_reduce(torch.zeros(1), async_op=True))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        for work in self.dummies:
            work.wait()
        self.dummies.clear()
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in self.params])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for p in self.params:
            if p.grad is not None:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


class DDPIndividualParameters(_Flat):
    pass


class DDPBucketed(_Flat):
    pass
'''


def forged(tmp_path, edits=(), files=None):
    """The answers with ``edits``, and each of ``files`` (a forgery's whole file, by the name the
    grader's tests give it) written over the answers' files it stands for (ANSWER_FILES)."""
    tree = apply_edits(make_submission(tmp_path), "forged", list(edits))
    for file, text in (files or {}).items():
        for path in ANSWER_FILES[file]:
            (tree / path).write_text(text)
    return tree


def test_zero_initialised_fsdp_and_optimizer_state_in_a_global(tmp_path):
    """Both forgeries in one submission (different problems' files): the FSDP that never
    communicates scores 0 (its ranks disagree, or it differs from training from the grader's
    weights); the global optimizer state is found and named, and caps the problem."""
    tree = forged(tmp_path, ANSWER_ZERO_INIT, {"cs336_systems/sharded_optimizer.py": GLOBAL_STATE})
    graded = grade(tree, tmp_path / "out", 1, "2026", QUICK, quiet=True, only=(ZERO, FSDP),
                   select="test_adamw or test_parameters_are_sharded or test_state_is_sharded or test_sgd_with_momentum")
    assert points(graded, FSDP) == 0
    lines = failures(graded, FSDP)
    assert len(lines) == 3 and all("hold different weights after step 1 of" in line
                                   or "differs from single-process training" in line for line in lines), lines
    lines = failures(graded, ZERO)
    assert len(lines) == 2 and all(f"not sharded {named_for(ZERO)}" in line and "read from outside the rank" in line
                                   for line in lines), lines
    assert points(graded, ZERO) == pytest.approx(15 / 7, abs=2e-4)  # the SGD test's share of those selected


def test_dummy_all_reduces_during_backward_do_not_overlap(tmp_path):
    graded = grade(forged(tmp_path, files={"cs336_systems/ddp.py": DUMMY_OVERLAP}), tmp_path / "out", 1, "2025", QUICK,
                   quiet=True, only=(PER_PARAMETER, BUCKETED),
                   select="test_matches_single_process or test_communicates_during_backward "
                          "or test_all_reduces_follow_bucket_size")
    overlap = [t.output for t in graded.tests if "test_communicates_during_backward" in t.name]
    assert len(overlap) == 2 and all("do not carry the gradients" in line for line in overlap), overlap
    sizes = {t.name.split("[")[-1]: t.passed for t in graded.tests if "follow_bucket_size" in t.name}
    assert sizes == {"0.01]": False, "1.0]": True}
    assert points(graded, PER_PARAMETER) == pytest.approx(5 / 3, abs=2e-4)
    assert points(graded, BUCKETED) == pytest.approx(8 / 3, abs=2e-4)
