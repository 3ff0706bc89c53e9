"""Before the first submission: can this grader start ranks here at all?

A set-up that cannot start ranks (an interpreter or packages that the ranks' view of the file
systems hides, a torch without gloo, a namespace that refuses loopback) fails every test of
every submission the same way, and a grade written from that would be a zero the student did
not earn. So the first ``grade`` of a process grades a probe of the grader's own first: a
submission it writes itself (a plain, blocking DDP), one test, through the very path a student's
takes (scratch copy, containment, fork server, gloo group, the suite's comparison). If that test
does not pass, nothing is graded: ``SetupError`` says why in one line and what to do.

Each later test that could not start its ranks before the submission's code ran (ranks.py:
``GRADER_FAILURE``) is the grader's failure too: the harness then writes no grade for that
submission (``GraderFailure``) and a folder's row says "not graded", to be graded again.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

PROBLEM = "ddp_overlap_individual_parameters"
TEST = "test_matches_single_process"  # one rank group of 2, a few steps: a few seconds
ADVICE = ("check the limits (--memory-gb, --test-timeout), and that Python and its packages are installed where "
          "every user can read them (or grade as root with namespaces)")

PROBE_ADAPTERS = '''"""The grader's own probe: a plain DDP (broadcast at construction, one blocking average)."""
import torch
import torch.distributed as dist


class ProbeDDP(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def average_gradients(self):
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())


def get_ddp_individual_parameters(module):
    return ProbeDDP(module)


def ddp_individual_parameters_on_after_backward(ddp_model, optimizer):
    ddp_model.average_gradients()
'''


# How the reason of a test begins whose every failing rank failed before the submission's code
# ran (confinement, the path, torch, joining the gloo group): a rank's own reasons begin "rank N:".
GRADER_FAILURE = "grader failure: "


class SetupError(RuntimeError):
    """This grader cannot run ranks here; nothing was graded. The message is one line."""


class GraderFailure(RuntimeError):
    """A submission's test could not start its ranks before the submission's code ran: no grade
    is written for it. The message is one line."""


_passed: set[tuple] = set()


def _setting(limits) -> tuple:
    from grading.isolation import student
    from grading.isolation.containment import namespaces_available

    return sys.executable, namespaces_available(), student.can_switch(), limits.memory_gb, limits.open_files


def ensure(limits) -> None:
    """Grade the probe once per process and setting; raise SetupError if it does not pass."""
    from grading.harness import Limits, grade

    setting = _setting(limits)
    if setting in _passed:
        return
    with tempfile.TemporaryDirectory(prefix="grading-selfcheck-") as tmp:
        probe = Path(tmp) / "probe"
        (probe / "tests").mkdir(parents=True)
        (probe / "tests" / "__init__.py").write_text("")
        (probe / "tests" / "adapters.py").write_text(PROBE_ADAPTERS)
        probe_limits = Limits(test_timeout_s=limits.test_timeout_s, submission_timeout_s=min(300.0, limits.submission_timeout_s),
                              memory_gb=limits.memory_gb, open_files=limits.open_files)
        try:
            graded = grade(probe, Path(tmp) / "out", 1, "2025", probe_limits, quiet=True, only=(PROBLEM,),
                           select=TEST, self_check=False)
        except GraderFailure as e:
            raise SetupError(f"the grader cannot start ranks here, so it graded nothing: {e}; {ADVICE}") from e
    tests = [t for t in graded.tests if t.name.split("::")[-1].startswith(TEST)]
    if not tests or not all(t.passed for t in tests):
        failed = [t for t in tests if not t.passed] or [t for t in graded.tests if t.reason]
        reason = failed[0].reason if failed else "its test did not run"
        raise SetupError(f"the grader's own probe submission failed here, so it graded nothing: {reason[:300]}; "
                         f"{ADVICE}")
    _passed.add(setting)
