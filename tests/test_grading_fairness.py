"""Correct code keeps every point whatever it imports or prints (issue 46).

The grader reads what a rank stores from outside it (grading/readings/memory.py), and what a rank does
before its model exists is in that reading unless taken out by design. Each of these once cost
the answers points they deserve: the course's own ``cs336_basics`` (its model imports einx,
einops and jaxtyping: 25/35), an adapters file that imports a ``torch.compile``'d FlashAttention
(15/35), one that imports a plotting module (matplotlib, numpy: 15/35), and ranks that print
megabytes (the capture was charged to the rank; a 436 MB log in OUT). Here all four are in one
submission, the worst case, graded on the problems whose checks read memory from outside, with
lines that held correct code while a text scan was a witness (issue 51): an unused memory-mapped
``torch.load``, an unused ``ctypes`` helper, and a ``#`` inside a string on a line that names
``ctypes``. A line that never runs holds nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grading.harness import grade
from tests.answers_fixture import with_imports
from tests.test_grading import FSDP, QUICK, ZERO, make_submission, points, unpassed

pytestmark = pytest.mark.problem("beyond")

UNUSED = '''"""Helpers kept for later, never called while the suite runs."""
import ctypes

import torch

TAG = "#1"; KIND = ctypes.c_int  # a '#' in a string, then ctypes on the same line


def load_checkpoint(path):
    return torch.load(path, mmap=True, weights_only=True)


def libc_version():
    return ctypes.CDLL(None).gnu_get_libc_version()
'''

# 1 MiB to stdout and 1 MiB to stderr each time a rank builds a wrapper: 2 MiB per rank per test.
TALK = '''
import sys

_LINE = "x" * 1023 + "\\n"


def _talk():
    sys.stdout.write(_LINE * 1024)
    sys.stderr.write(_LINE * 1024)
    sys.stdout.flush()
'''


def ordinary(tmp_path: Path) -> Path:
    """The answers with the course's model imports, a compiled, a plotting and an unused helpers'
    module imported by the adapters, and a constructor that prints 2 MiB."""
    tree = with_imports(make_submission(tmp_path), "course", "compile", "plots")
    (tree / "cs336_systems" / "unused.py").write_text(UNUSED)
    adapters = tree / "tests" / "adapters.py"
    text = adapters.read_text().replace(
        "from cs336_systems.answers import adapters as answers\n",
        "from cs336_systems.answers import adapters as answers\nfrom cs336_systems.unused import load_checkpoint  # noqa: F401\n"
        + TALK)
    for name in ("get_fsdp", "get_sharded_optimizer"):
        text = text.replace(f"def {name}(*args, **kwargs):\n", f"def {name}(*args, **kwargs):\n    _talk()\n")
    adapters.write_text(text)
    return tree


def test_ordinary_imports_and_prints_keep_every_point(tmp_path):
    out = tmp_path / "out"
    graded = grade(ordinary(tmp_path), out, 1, "2026", QUICK, quiet=True, only=(ZERO, FSDP),
                   select="test_matches_single_process or test_state_is_sharded or test_every_rank_keeps_its_share "
                          "or test_parameters_are_sharded or test_gathered_weights_are_freed")
    assert (points(graded, ZERO), points(graded, FSDP)) == (15.0, 15.0), unpassed(graded)
    assert not any(r.held for r in graded.rows), unpassed(graded)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert size < 1 << 20, f"OUT holds {size} bytes: the ranks' prints reached it"
    assert json.loads((out / "results.json").read_text())["score"] == pytest.approx(30.0)
