"""Issue 57: memory is what the kernel charges the rank, no process a rank inherits from runs the
submission, and readings cap only with a margin.

* The reading is the rank's memory cgroup's total charge: pages a pipe holds after the memfd
  they were spliced from was truncated sit in none of the parts issue 51 added up (anonymous,
  file, kernel, socket), and are in the charge.
* A reading caps only beyond its bound by more than ``memory.MARGIN``, by every witness (the
  charge, and its parts where a cgroup was read); near the bound, or where the two disagree
  across it, the problem is held with both readings.
* The fork server imports only the environment's libraries, never a package the submission
  declares, whatever the harness names: each rank imports its declared packages itself, before
  its baseline.
* Issue 57's route 3, rebuilt: a declared package of the submission's own maps 96 MiB of shared
  anonymous memory at import, and the unsharded optimizer parks its state there. Imported in the
  fork server it was every rank's and no rank's; now each rank maps its own, charged to its
  baseline, and the optimizer earns no more than the weak code's capped 5, in namespace mode and
  as Gradescope's container runs it. An honest package the optimizer imports lazily inside
  ``add_param_group`` costs nothing.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from grading.harness import grade
from grading.intake import packages
from grading.isolation import sandbox, student
from grading.readings import outside, review
from grading.readings.bounds import MARGIN
from grading.readings.memory import MB, freed_finding, state_finding, weights_finding
from tests.answers_fixture import FSDP_FILE, PER_PARAMETER_FILE, ZERO_FILE, apply_edits
from tests.test_grading import FSDP, PER_PARAMETER, QUICK, ZERO, make_submission, points, unpassed
from tests.test_grading_sealed import POINT_TESTS

pytestmark = pytest.mark.problem("beyond")

REPO = Path(__file__).resolve().parent.parent


def _pipes_keep_truncated_pages(ctx, job) -> dict:
    """Rank side: 8 MiB written to a memfd, spliced into pipes (each pipe then references the
    file's pages, no copy), and the memfd truncated: the pages are the pipes' alone."""
    import fcntl

    ctx.pause(outside.BEFORE)
    try:
        fd = os.memfd_create("kept")
    except OSError as e:  # a policy that refuses it (seccomp): nothing to read here
        return {"refused": str(e)}
    os.write(fd, os.urandom(8 * MB))
    kept = []
    for offset in range(0, 8 * MB, MB):
        r, w = os.pipe()
        fcntl.fcntl(w, 1031, MB)  # F_SETPIPE_SZ: 1 MiB a pipe
        moved = 0
        while moved < MB:
            moved += os.splice(fd, w, MB - moved, offset_src=offset + moved)
        kept += [r, w]
    os.ftruncate(fd, 0)
    os.close(fd)
    ctx.pause("after step 1")
    return {"pipes": len(kept) // 2}


def test_pages_pipes_hold_after_their_file_is_truncated_are_in_the_charge():
    """Issue 57's route 1 on the reading itself: the charge grows by the 8 MiB the pipes hold,
    where the parts issue 51 judged (resident anonymous memory, file, kernel and socket charges)
    grow by less than half of it."""
    from grading.isolation import rank_cgroups, wire
    from grading.isolation.ranks import run_ranks

    if rank_cgroups.RankCgroups.make(1) is None:
        pytest.skip("no memory cgroup can be made here: ranks are read from /proc alone")
    (report,) = run_ranks(_pipes_keep_truncated_pages, 1, [wire.encode({})], timeout_s=60)
    if "refused" in report:
        pytest.skip(f"this grader's policy refuses memfd_create in a rank: {report['refused']}")
    before, after = report[outside.KEY]
    assert after["bytes"] - before["bytes"] >= 7.5 * MB, (before, after)
    assert after["parts"] - before["parts"] < 4 * MB, (before, after)


def _measured(imported_mb: float, after_step: list[float], parts: list[float] | None = None) -> dict:
    """A measured rank's readings (MB above its first pause): the charge, and its parts."""
    def reading(label: str, charge: float, part: float) -> dict:
        return {"label": label, "bytes": 400 * MB + int(charge * MB), "parts": 300 * MB + int(part * MB),
                "anon_charged": 200 * MB + int(charge * MB), "file": 0, "kernel": 0, "sock": 0, "source": "cgroup v1"}

    parts = after_step if parts is None else parts
    return {"outside": [reading(outside.BEFORE, 0, 0), reading(outside.IMPORTED, imported_mb, imported_mb)] +
            [reading(f"after step {s}", b, p) for s, (b, p) in enumerate(zip(after_step, parts), 1)]}


STATE, MODEL = 12 * MB, 6 * MB  # the measured optimizer's AdamW state and model (checks.MEASURED_WIDTH)
WEIGHTS = {name: int(6.2 * MB) for name in ("embedding", "up", "down", "lm_head")}


def test_a_reading_caps_only_beyond_its_bound_by_the_margin_by_every_witness():
    """The state's bound at 2 ranks is 9.0 MB beyond the model's 6.0. A reading over it by more
    than the margin, by the charge and its parts, caps; over it by less, or by one witness and
    not the other, holds with both readings and the finding it would have made; under it, passes."""
    bound = STATE * 0.75
    at = lambda mb: MODEL / MB + 1.4 + mb  # noqa: E731 - what the rank reads, held above the model and import
    far = (bound * (1 + 2 * MARGIN)) / MB
    capped = state_finding([_measured(1.4, [at(far)] * 3)] * 2, STATE, MODEL, ZERO, "over")
    assert capped.startswith("rank 0 holds") and "not sharded" in capped and not review.is_held(capped), capped
    assert "of the charge since its import: anonymous" in capped, capped  # the parts explain it
    near = (bound * (1 + MARGIN / 2)) / MB
    held = state_finding([_measured(1.4, [at(near)] * 3)] * 2, STATE, MODEL, ZERO, "over")
    assert review.is_held(held) and f"less than the {MARGIN:.0%} margin" in held, held
    assert "the charge 9.2 MB against 9.0 MB, its parts 9.2 MB against 9.0 MB" in held, held
    assert "the finding were it capped: rank 0 holds" in held, held
    split = state_finding([_measured(1.4, [at(far)] * 3, [at(6.0)] * 3)] * 2, STATE, MODEL, ZERO, "over")
    assert review.is_held(split) and "memory charge and its parts disagree across the bound" in split, split
    assert state_finding([_measured(1.4, [at(6.3)] * 3)] * 2, STATE, MODEL, ZERO, "over") == ""
    # a reading with no parts (no cgroup: what the rank's processes hold) is its one witness
    alone = [{"outside": [{k: v for k, v in r.items() if k != "parts"} for r in _measured(1.4, [at(near)] * 3)["outside"]]}]
    assert review.is_held(state_finding(alone * 2, STATE, MODEL, ZERO, "over"))


def test_every_memory_finding_holds_near_its_bound():
    """The one margin in every finding that caps on memory: the state's floor (from below),
    weights between steps, gathered weights kept between forward and backward."""
    share_floor = STATE / 3 / 3  # 3 ranks: a third of a rank's share
    reports = [_measured(1.0, [(MODEL + share_floor * (1 - MARGIN / 2)) / MB + 1.0] * 3)] * 3
    assert review.is_held(state_finding(reports, STATE, MODEL, ZERO, "under"))
    assert not review.is_held(found := state_finding([_measured(1.0, [MODEL / MB + 1.0] * 3)] * 3, STATE, MODEL, ZERO,
                                                     "under")) and "no share" in found, found
    total = sum(WEIGHTS.values())
    bound = total / 2 + 1.2 * MB + 6.2 * MB / 4  # 1/2 of each weight, what training keeps, half a weight kept whole
    near = [_measured(1.4, [(bound * (1 + MARGIN / 2)) / MB + 1.4] * 2)] * 2
    assert review.is_held(weights_finding(near, WEIGHTS, 0, "fsdp"))
    far = [_measured(1.4, [(bound * (1 + 2 * MARGIN)) / MB + 1.4] * 2)] * 2
    assert not review.is_held(found := weights_finding(far, WEIGHTS, 0, "fsdp")) and "not sharded" in found, found

    def between(extra_mb: float) -> dict:
        base = _measured(1.4, [14.0, 14.0, 14.0])["outside"]
        rows = base[:2]
        for s in (1, 2, 3):
            rows += [{**base[1 + s], "label": f"between forward and backward of step {s}",
                      "bytes": base[1 + s]["bytes"] + int(extra_mb * MB), "parts": base[1 + s]["parts"] + int(extra_mb * MB)},
                     base[1 + s]]
        return {"outside": rows}

    one = 6.2
    assert review.is_held(freed_finding([between(1.5 * one * (1 + MARGIN / 2))] * 3, WEIGHTS, 0, "fsdp"))
    assert freed_finding([between(1.5 * one * (1 + 2 * MARGIN))] * 3, WEIGHTS, 0, "fsdp").startswith("the gathered weights")
    assert freed_finding([between(one)] * 3, WEIGHTS, 0, "fsdp") == ""


def test_shared_memory_a_rank_maps_once_imported_holds_a_reading_within_its_bound():
    """The kernel's witness to route 3 however the arena is hidden from the walks: a rank whose
    processes map more than 1 MB of shared memory (``RssShmem``) from its import on is held
    with that reading, whatever its memory reads; a rank that maps none is not."""
    from grading.readings.memory import judged
    from grading.suite.checks import Run

    fine = lambda run: ""  # noqa: E731
    quiet = [_measured(1.4, [14.1, 14.1])] * 2
    assert judged(Run(quiet), lambda: None, fine, fine) == []
    mapped = {"outside": [{**r, "shmem": 0 if r["label"] == outside.BEFORE else 96 * MB} for r in quiet[0]["outside"]]}
    [held] = judged(Run([mapped, quiet[1]]), lambda: None, fine, fine)
    assert review.is_held(held) and "rank 0's processes map 96.0 MB of shared memory" in held, held


def wheel(folder: Path, name: str, source: str) -> Path:
    """A folder holding one pure-Python wheel of ``name`` 1.0 whose module is ``source``, made
    here: a course wheelhouse, no network needed."""
    module = name.replace("-", "_")
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{module}-1.0.dist-info"
    files = {f"{module}/__init__.py": source.encode(),
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for path, data in files.items()) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{module}-1.0-py3-none-any.whl", "w") as made:
        for path, data in {**files, f"{info}/RECORD": record.encode()}.items():
            made.writestr(path, data)
    return folder


def declaring(tree: Path, name: str) -> Path:
    """``tree`` whose pyproject.toml declares ``name`` (pinned by its uv.lock)."""
    (tree / "pyproject.toml").write_text(f'[project]\nname = "student"\nversion = "0.1"\ndependencies = ["torch", "{name}"]\n')
    (tree / "uv.lock").write_text(f'version = 1\n\n[[package]]\nname = "{name}"\nversion = "1.0"\n')
    return tree


def test_the_fork_server_never_imports_what_the_submission_declares(tmp_path):
    """Whatever the harness names for the fork server, a module found only in the submission's
    layer is not imported there (its folder is never on the server's path); a rank's own
    ``import_declared`` imports it from its path."""
    from grading.isolation.preload import DECLARED_ENV, PRELOAD_ENV

    layer = tmp_path / "layer"
    (layer / "declared_mark").mkdir(parents=True)
    (layer / "declared_mark" / "__init__.py").write_text("import os\nos.environ['DECLARED_MARK_RAN'] = '1'\n")
    env = {**os.environ, "GRADING_RANK_SERVER": "1", PRELOAD_ENV: "declared_mark,json",
           packages.LAYER_ENV: str(layer), "PYTHONPATH": str(REPO)}
    server = subprocess.run([sys.executable, "-c", "import grading.isolation.preload, sys; "
                             "print('declared_mark' in sys.modules, 'json' in sys.modules)"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert server.stdout.split() == ["False", "True"], server.stderr[-2000:]
    rank = subprocess.run([sys.executable, "-c", f"import sys; sys.path.append({str(layer)!r}); "
                           "from grading.isolation.preload import import_declared; import_declared(); "
                           "print('declared_mark' in sys.modules)"],
                          capture_output=True, text=True, env={**env, DECLARED_ENV: "declared_mark"}, cwd=tmp_path,
                          timeout=60)
    assert rank.stdout.split() == ["True"], rank.stderr[-2000:]


def test_a_declared_packages_modules_are_walked_as_the_submissions_own(tmp_path, monkeypatch):
    """What the packages installed for a submission hold once imported is walked with its own
    modules (training.imported_tensors): a buffer one of them makes at import and that is written
    to later witnesses for review, as the submission's own would."""
    from grading.suite import training

    layer, root = tmp_path / "layer", tmp_path / "submission"
    (layer / "arena_mark").mkdir(parents=True)
    root.mkdir()
    (layer / "arena_mark" / "__init__.py").write_text("ARENA = bytearray(2 << 20)\n")
    monkeypatch.setenv("GRADING_SUBMISSION_ROOTS", str(root))
    monkeypatch.setenv(packages.LAYER_ENV, str(layer))
    monkeypatch.syspath_prepend(str(layer))
    import arena_mark

    try:
        before = training.imported_tensors()
        assert before["imported"] >= 2 << 20 and "arena_mark" in before["imported_largest"], before
        arena_mark.ARENA[:8] = b"kept now"
        assert training.imported_since(before)["imported_changed"], before
    finally:
        sys.modules.pop("arena_mark", None)


ARENA = "shared-arena"
ARENA_SOURCE = '''"""96 MiB of shared anonymous memory, mapped and touched at import (issue 57's route 3)."""
import mmap

SIZE = 96 << 20
THIRD = SIZE // 3  # a rank's own part, so that ranks sharing the arena do not clobber each other
ARENA = mmap.mmap(-1, SIZE)  # MAP_SHARED | MAP_ANONYMOUS
for _page in range(0, SIZE, mmap.PAGESIZE):
    ARENA[_page] = 0
_parked = {}  # key -> (offset, shape, dtype): no tensor is kept, only where its bytes lie
_used = {}


def view(offset, count, dtype):
    import torch

    return torch.frombuffer(ARENA, dtype=dtype, count=count, offset=offset)


def park(key, tensor, rank):
    """``tensor``'s bytes into the rank's own third; nothing of it kept but their place."""
    nbytes = tensor.numel() * tensor.element_size()
    offset = _parked[key][0] if key in _parked else _used.get(rank, 0)
    if key not in _parked:
        if offset + nbytes > THIRD:
            offset = 0
        _used[rank] = offset + nbytes
    _parked[key] = (offset, tuple(tensor.shape), tensor.dtype)
    view(rank * THIRD + offset, tensor.numel(), tensor.dtype).copy_(tensor.reshape(-1))


def take(key, rank):
    """A fresh tensor of what ``park`` put there."""
    offset, shape, dtype = _parked[key]
    count = 1
    for n in shape:
        count *= n
    return view(rank * THIRD + offset, count, dtype).clone().view(shape)
'''

# The weak code of issue 57, its state, weights and gradients in the arena, out of every count.
# DDP: all-reduces of zeros as large as the gradients during backward (the probe and the
# loopback see them), the real average after backward through the arena's last third, which
# ranks share when the fork server mapped it. The optimizer: every rank steps every parameter
# (the answers' mutant); between steps it keeps its own share's state, as a sharded one would,
# and parks the rest. FSDP: the answers' shards, and a full copy of each weight parked.
ZEROS = [(PER_PARAMETER_FILE, "        self.handles.append(dist.all_reduce(param.grad, async_op=True))\n",
          "        self.handles.append(dist.all_reduce(torch.zeros_like(param.grad), async_op=True))\n"),
         (PER_PARAMETER_FILE, "        self.handles.clear()\n", "        self.handles.clear()\n        _average_in_arena(self)\n"),
         (PER_PARAMETER_FILE, "\n\nclass DDPIndividualParameters", '''

def _average_in_arena(ddp):
    """Every rank's gradients (already divided by the world size) summed through the arena."""
    import shared_arena

    grads = [p.grad for p in ddp.module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    rank, ws = dist.get_rank(), dist.get_world_size()
    rows = shared_arena.view(2 * shared_arena.THIRD, flat.numel() * ws, flat.dtype).view(ws, flat.numel())
    dist.barrier()
    rows[rank].copy_(flat)
    dist.barrier()
    total = rows.sum(0)
    dist.barrier()
    offset = 0
    for g in grads:
        g.copy_(total[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class DDPIndividualParameters''')]
PARK_STATE = [(ZERO_FILE, "        loss = self.local.step(closure, **kwargs)\n",
               "        _restore(self)\n        loss = self.local.step(closure, **kwargs)\n        _park(self)\n"),
              (ZERO_FILE, "\n\nclass ShardedOptimizer", '''

def _park(opt):
    """The state of every parameter another rank owns, into the arena; none of it kept here."""
    import shared_arena

    rank, opt.parked = dist.get_rank(), []
    for p in [p for p in opt.local.state if opt.owner[p] != rank]:
        state = opt.local.state.pop(p)
        for key, value in state.items():
            shared_arena.park((id(p), key), value, rank)
        opt.parked.append((p, list(state)))


def _restore(opt):
    import shared_arena

    for p, keys in getattr(opt, "parked", []):
        opt.local.state[p] = {key: shared_arena.take((id(p), key), dist.get_rank()) for key in keys}
    opt.parked = []


class ShardedOptimizer''')]
PARK_WEIGHTS = [(FSDP_FILE, "        module.full_copy = full.clone()\n",
                 "        import shared_arena\n        shared_arena.park(('full', id(module)), full, fsdp.rank)\n")]
HONEST_WEAK = {PER_PARAMETER: 5 / 3, ZERO: 5.0, FSDP: 5.0}  # the caps: flat after backward, unsharded, unsharded
ROUTE_3_TESTS = ("test_matches_single_process or test_three_ranks or test_communicates_during_backward or "
                 "test_state_is_sharded or test_every_rank_keeps_its_share or test_parameters_are_sharded")


def route_3(tmp_path: Path) -> Path:
    """Issue 57's route 3: the weak code, its state, weights and gradients in its declared
    package's shared arena."""
    tree = declaring(make_submission(tmp_path / "arena", "full_optimizer_state+full_weights"), ARENA)
    return apply_edits(tree, "arena", ZEROS + PARK_STATE + PARK_WEIGHTS)


def contained(tree: Path, out: Path, only: tuple[str, ...], select: str) -> dict:
    """Graded as Gradescope's container runs it (tests/fallback_grade.py; ``GRADING_PRIVATE_STORAGE=0``)."""
    if not student.can_switch() or shutil.which("unshare") is None:
        pytest.skip("the container's mode needs root")
    args = {"submission": str(tree), "out": str(out), "edition": "2026", "only": list(only), "select": select,
            "test_timeout_s": QUICK.test_timeout_s, "submission_timeout_s": QUICK.submission_timeout_s}
    # uv's cache outside /root, which the container's mode covers with an empty folder
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-m", "tests.fallback_grade",
                           json.dumps(args)], capture_output=True, text=True, timeout=1500, cwd=REPO,
                          env={**os.environ, sandbox.PRIVATE_STORAGE_ENV: "0", "UV_CACHE_DIR": str(out.parent / "uv-cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])[tree.name]


def test_a_declared_package_that_maps_shared_memory_earns_the_weak_grade(tmp_path, monkeypatch):
    """Route 3: weak code keeps its optimizer state and FSDP weights in 96 MiB of shared
    anonymous memory its declared package maps at import, and averages its DDP gradients through
    it behind all-reduces of zeros. Imported in each rank, before its baseline, the arena is that
    rank's alone: the average reaches no other rank (its training fails) and what it keeps there
    is in its baseline, its own tensors and buffers say so (a hold). Each problem earns at most
    the weak code's honest grade, in namespace mode and as Gradescope's container grades it."""
    tree = route_3(tmp_path)
    monkeypatch.setenv(packages.WHEELHOUSE_ENV, str(wheel(tmp_path / "wheels", ARENA, ARENA_SOURCE)))
    only = (PER_PARAMETER, ZERO, FSDP)
    graded = grade(tree, tmp_path / "out", 1, "2026", QUICK, quiet=True, only=only, select=ROUTE_3_TESTS)
    assert f"{ARENA}==1.0" in (tmp_path / "out" / "grade.md").read_text()
    for problem, most in HONEST_WEAK.items():
        assert points(graded, problem) <= most + 1e-3, (problem, unpassed(graded))
    box = contained(tree, tmp_path / "out-container", only, ROUTE_3_TESTS)
    assert f"{ARENA}==1.0" in (tmp_path / "out-container" / "grade.md").read_text()
    for problem, most in HONEST_WEAK.items():
        assert box["points"][problem] <= most + 1e-3, (problem, box["outputs"])


# An honest package, about 8 MB of objects made at import, that the answers' optimizer imports
# lazily, inside add_param_group (a real student's `from rich import print` there held 8 points).
LAZY = "lazy-helper"
LAZY_SOURCE = '''"""Tables of objects made at import, as a formatting library's are."""
TABLE = [str(i) * 8 for i in range(100_000)]


def noted(group):
    return len(group["params"])
'''


def test_a_declared_package_imported_lazily_after_the_baseline_costs_nothing(tmp_path, monkeypatch):
    """The answers' optimizer imports a declared package inside ``add_param_group``, after its
    baseline: each rank imported it before its baseline (preload.import_declared), so the lazy
    import reads as nothing stored: every point of the state tests, none held."""
    tree = declaring(make_submission(tmp_path / "lazy"), LAZY)
    added = "        super().add_param_group(param_group)  # fills in the defaults, refuses duplicates\n"
    apply_edits(tree, "lazy", [(ZERO_FILE, added, added + "        from lazy_helper import noted\n"
                                                          "        noted(self.param_groups[-1])\n")])
    monkeypatch.setenv(packages.WHEELHOUSE_ENV, str(wheel(tmp_path / "wheels", LAZY, LAZY_SOURCE)))
    graded = grade(tree, tmp_path / "out", 1, "2026", QUICK, quiet=True, only=(ZERO,),
                   select=POINT_TESTS + " or test_add_param_group")
    assert points(graded, ZERO) == 15.0 and not any(t.held for t in graded.tests), unpassed(graded)
    assert f"{LAZY}==1.0" in (tmp_path / "out" / "grade.md").read_text()
