"""Three patterns of real student solutions that lost points a TA gives back (issue 57), rebuilt
from their description on the answers (tests/answers_fixture.py), each graded as it deserves.

* **Its own packages, as ``uv sync`` installs them.** The student's assignment-1 ``cs336_basics``
  is a path dependency of its project and asks for its own version at import
  (``importlib.metadata.version``): the course's uv environment has that metadata, and so must the
  grader's (every test failed at import: 0/28 for a fair 24). A submission whose every test still
  fails at import is held with the error, never zeroed in silence; a name it imports that nothing
  provides is named in grade.md's first lines.
* **A bucketed DDP that sends 75% of the gradients above the probe before it** (its buckets close
  only once two gradients are in, so the layer above the probe waits for the first layer's): past
  the overlap check's pass mark of 70%. The rank's wait at the probe asked for 80%, timed out,
  and never waited again; later readings caught the last all-reduce in flight (capped).
* **An FSDP that keeps each reduce-scatter's work handle and full gradient until the next
  forward**, and gathers each Linear twice in forward (a prefetch it waits for, then its own
  gather), cast to the compute dtype first. Between steps its weights are 1/ws, as its own
  tensors say, while the reading from outside counts the gradients: held, never capped; its
  gathers are in bfloat16, as the rank's own record of them says, not float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from grading.harness import grade
from grading.intake import packages
from grading.readings.review import HELD
from tests.answers_fixture import BUCKETED_FILE, FSDP_FILE, apply_edits
from tests.test_grading import BUCKETED, FSDP, PER_PARAMETER, QUICK, make_submission, points, unpassed

pytestmark = pytest.mark.problem("beyond")

ASKS_ITS_VERSION = '''"""The student's assignment-1 package."""
import importlib.metadata

__version__ = importlib.metadata.version("cs336_basics")
'''

PROJECT = '''[project]
name = "cs336-systems"
version = "1.0.0"
dependencies = ["cs336-basics"]

[tool.uv.sources]
cs336-basics = { path = "./cs336-basics", editable = true }
'''

BASICS_PROJECT = '''[project]
name = "cs336_basics"
version = "1.0.3"

[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"
'''


def own_package_asks_its_version(tmp_path: Path, with_project: bool = True) -> Path:
    """The answers as a uv project whose ``cs336-basics`` is a path source and asks its own version
    at import; ``with_project=False``: that folder has no pyproject.toml (nothing declares it)."""
    tree = make_submission(tmp_path)
    (tree / "pyproject.toml").write_text(PROJECT)
    if with_project:
        (tree / "cs336-basics" / "pyproject.toml").write_text(BASICS_PROJECT)
    init = tree / "cs336-basics" / "cs336_basics" / "__init__.py"
    init.write_text(ASKS_ITS_VERSION + init.read_text())
    adapters = tree / "tests" / "adapters.py"  # its adapters import its model, as a student's do
    adapters.write_text(adapters.read_text().replace("from cs336_systems.answers import adapters as answers\n",
                                                     "from cs336_systems.answers import adapters as answers\n"
                                                     "from cs336_basics.model import Linear  # noqa: F401\n"))
    return tree


def test_own_projects_are_read_from_pyproject_and_written_as_metadata(tmp_path):
    """The metadata is static text from pyproject.toml (no build backend runs): a name that is no
    distribution name is skipped, a version PEP 440 does not read becomes "0", and
    ``importlib.metadata`` finds what was written."""
    import importlib.metadata

    tree = own_package_asks_its_version(tmp_path)
    (tree / "odd").mkdir()
    (tree / "odd" / "pyproject.toml").write_text('[project]\nname = "../../etc"\nversion = "1"\n')
    (tree / "dyn").mkdir()
    (tree / "dyn" / "pyproject.toml").write_text('[project]\nname = "dyn-pkg"\ndynamic = ["version"]\n')
    found = packages.own_projects(tree, [tree / "cs336-basics", tree / "odd", tree / "dyn"])
    assert found == [("cs336-systems", "1.0.0"), ("cs336_basics", "1.0.3"), ("dyn-pkg", "0")]
    layer = tmp_path / "layer"
    written = packages.write_metadata([("cs336_basics", "1.0.3"), ("dyn-pkg", "0")], layer)
    assert written == ["cs336_basics==1.0.3", "dyn-pkg==0"]
    dists = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(layer)])}
    assert dists == {"cs336_basics": "1.0.3", "dyn-pkg": "0"}
    assert packages.write_metadata([("cs336_basics", "1.0.3")], layer) == []  # the layer has it already


def test_a_name_nothing_provides_is_named(tmp_path):
    """A name the submission's files import that neither it nor the grader's environment provides
    is named in the remark; its own modules (a script's sibling) and the course's are not."""
    tree = make_submission(tmp_path)
    (tree / "scripts").mkdir()
    (tree / "scripts" / "helpers.py").write_text("X = 1\n")
    (tree / "scripts" / "bench.py").write_text("import helpers\nimport surely_not_installed_zq.sub\nimport torch\n")
    _, unresolved = packages.libraries([tree])
    assert packages.absent_imports(unresolved, tmp_path / "no-layer") == ["surely_not_installed_zq"]
    assert packages.absent_remark(["surely_not_installed_zq"]).startswith("Imports surely_not_installed_zq, which")


def test_own_package_that_asks_its_version_is_graded(tmp_path):
    """Pattern A: with its path package's metadata written as uv sync writes it, every test runs
    (before: every test failed at import, 0 points, no hold, no note)."""
    graded = grade(own_package_asks_its_version(tmp_path), tmp_path / "out", 1, "2025", QUICK, quiet=True,
                   only=(PER_PARAMETER,), select="test_matches_single_process")
    assert points(graded, PER_PARAMETER) == 5.0, unpassed(graded)
    assert not any(r.held for r in graded.rows)


def test_every_test_failing_at_import_is_held_with_the_error(tmp_path):
    """Where nothing declares the package (no pyproject.toml in its folder, so no metadata), every
    test fails at import: held for review with that error, and grade.md says so first."""
    graded = grade(own_package_asks_its_version(tmp_path, with_project=False), tmp_path / "out", 1, "2025", QUICK,
                   quiet=True, only=(PER_PARAMETER,), select="test_matches_single_process")
    failed = [t.output for t in graded.tests if not t.passed]
    assert failed and all(o.startswith(HELD + "every test failed while the submission's adapters were imported")
                          and "PackageNotFoundError" in o for o in failed), failed
    assert any(r.held for r in graded.rows)
    assert graded.remarks[0].startswith("Every test failed at import, held for review"), graded.remarks
    assert "PackageNotFoundError" in graded.remarks[0]


# Pattern B: a bucket closes once it is over the cap *and* holds two gradients, so at a cap smaller
# than any gradient buckets are pairs, and the layer above the probe waits for the first layer's.
PAIRED_BUCKETS = [(BUCKETED_FILE,
                   "            if bucket and bucket_bytes + nbytes > cap:  # close it before it holds more than the cap\n"
                   "                self.buckets.append(bucket)\n"
                   "                bucket, bucket_bytes = [], 0\n"
                   "            bucket.append(param)  # a parameter larger than the cap gets a bucket of its own\n"
                   "            bucket_bytes += nbytes\n",
                   "            bucket.append(param)\n"
                   "            bucket_bytes += nbytes\n"
                   "            if bucket_bytes > cap and len(bucket) > 1:  # two gradients a message at least\n"
                   "                self.buckets.append(bucket)\n"
                   "                bucket, bucket_bytes = [], 0\n")]


def test_bucketed_ddp_past_the_pass_mark_keeps_its_points(tmp_path):
    """Pattern B: 75% of the gradients above the probe are on their way when backward reaches it;
    the wait asks for the pass mark (70%), not more, in every judged step."""
    tree = apply_edits(make_submission(tmp_path), "paired_buckets", PAIRED_BUCKETS)
    graded = grade(tree, tmp_path / "out", 1, "2025", QUICK, quiet=True, only=(BUCKETED,),
                   select="test_communicates_during_backward or test_matches_single_process")
    assert points(graded, BUCKETED) == 8.0, unpassed(graded)


# Pattern C: the reduce-scatters' work handles and full gradients kept until the next forward, and
# every prefetched gather waited for and then made again (cast to the compute dtype first).
KEEPS_HANDLES = [
    (FSDP_FILE, "        self.fsdp.pending.append((self, out, dist.reduce_scatter_tensor(out, grad, async_op=True)))\n",
     "        self.fsdp.pending.append((self, out, dist.reduce_scatter_tensor(out, grad, async_op=True), grad))\n"),
    (FSDP_FILE, "        for layer, out, work in self.pending:\n", "        for layer, out, work, _ in self.pending:\n"),
    (FSDP_FILE, "        self.pending.clear()\n", "        self.done, self.pending = self.pending, []  # until the next forward\n"),
    (FSDP_FILE, "    def forward(self, *inputs, **kwargs):\n        output = self.module(*inputs, **kwargs)\n",
     "    def forward(self, *inputs, **kwargs):\n        self.done = []\n        output = self.module(*inputs, **kwargs)\n"),
    (FSDP_FILE, "        full, work = self.prefetched or self.start_gather()\n        self.prefetched = None\n",
     "        if self.prefetched is not None:  # the prefetch is waited for, and the layer gathers its own\n"
     "            self.prefetched[1].wait()\n            self.prefetched = None\n"
     "        full, work = self.start_gather()\n"),
]


def test_fsdp_keeping_its_reduce_scatters_is_held_not_capped(tmp_path):
    """Pattern C: between steps the reading from outside counts the kept gradients and its weights
    are 1/ws: the witnesses disagree, held with both; its bfloat16 gathers are read as bfloat16."""
    tree = apply_edits(make_submission(tmp_path), "keeps_handles", KEEPS_HANDLES)
    graded = grade(tree, tmp_path / "out", 1, "2026", QUICK, quiet=True, only=(FSDP,),
                   select="test_parameters_are_sharded or test_gradients_are_reduce_scattered")
    lost = {t.name: t.output for t in graded.tests if not t.passed}
    assert set(lost) <= {"test_fsdp.py::test_parameters_are_sharded[2]", "test_fsdp.py::test_parameters_are_sharded[3]"}, lost
    assert all(o.startswith(HELD + "the reading from outside and the rank's own tensors disagree") and "outside:" in o
               and "(its weights:" in o for o in lost.values()), lost
    assert all(not t.output.startswith("weights are not sharded") for t in graded.tests)


class _Ctx:
    """A rank's context for the gate alone: its holds recorded, none stopping."""

    def __init__(self):
        self.holds: list[str] = []

    def hold(self, label: str) -> bytes:
        self.holds.append(label)
        return b""


class _Work:
    def __init__(self, done: bool):
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def test_the_wait_at_the_probe_asks_for_the_pass_mark_in_every_judged_step(monkeypatch):
    """The rule behind pattern B, on the gate alone (a clock and a loopback counter of the test's
    own): the wait ends once the bytes reach what it was asked (the pass mark, from
    carried.ddp_overlap_finding: EARLY, no more), waits again in the step after one that ran out,
    never in step 1 (not judged), and not at all once every collective issued is done."""
    from grading.readings import carried, probes, traffic
    from grading.suite import training

    assert carried.EARLY == 0.7 and not hasattr(carried, "EARLY_WAIT")
    clock = {"t": 0.0}
    monkeypatch.setattr(training.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(training.time, "sleep", lambda s: clock.__setitem__("t", clock["t"] + s))
    sent = {"rate": 0.0, "since": 0.0}  # the loopback's bytes: at ``rate`` per second from ``since``
    monkeypatch.setattr(traffic, "loopback_bytes", lambda: int(sent["rate"] * (clock["t"] - sent["since"])))
    monkeypatch.setattr(probes, "LOG", probes.CollectiveLog())
    gate = training._Gate(_Ctx(), {"above": 1000})

    def probe_at(step: int, pending: list, rate: float) -> float:
        gate.before_forward(step)
        probes.LOG.pending.extend(pending)
        sent["rate"], sent["since"], start = rate, clock["t"], clock["t"]
        gate.start = 0  # the step's count starts as the bytes start
        gate.at_probe()
        assert probes.LOG.pending is None  # no handle kept past the probe
        return clock["t"] - start

    assert probe_at(1, [_Work(False)], 0.0) == 0  # step 1: no wait
    assert probe_at(2, [_Work(False)], 0.0) == pytest.approx(gate.WAIT_S, abs=0.01)  # ran out
    assert 0.9 < probe_at(3, [_Work(False)], 1000.0) < 1.1  # and still waits in the next step, until the bytes are there
    assert probe_at(4, [_Work(True)], 0.0) == 0  # every collective done: nothing more is coming
    assert probe_at(5, [], 0.0) == 0  # nothing sent during backward: no wait
    assert gate.ctx.holds[-1] == "backward reached the first layer of step 5"
