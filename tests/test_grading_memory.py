"""The grader reads a rank's memory from outside it (grading/readings/outside.py) and judges sharding from
what it read (grading/readings/memory.py).

* The pause protocol on a plain forked process: what it allocates between two pauses shows in
  the grader's reading, whatever the process names or hides; a process that does not stop is
  read as unread, never as small.
* Each sharding finding on the readings a correct rank and a weak one give (the megabytes of
  the correct fixture, measured under load: a spread of 0.1 MB): the correct one passes, a
  weight or a share short fails, and the finding says what a TA needs; judged beyond what the
  grader's own ranks hold (a calibration whose failure is the grader's) and the submission's
  import (all of it: what a rank does before its model exists is not what it stores).
* The verdict hears every witness (memory.judged): a finding stands only when a second run,
  judged whole, repeats it and the ranks' own tensors agree; where a witness disagrees the
  problem is held for review.

What a rank's memory cgroup counts is tests/test_grading_rank_cgroups.py's.
"""

from __future__ import annotations

import os
import select
import signal
import time

import pytest
import torch

from grading.readings import outside
from grading.readings import review
from grading.suite.checks import Run, findings
from grading.readings.memory import FREED_HANDOUT, MB, freed_finding, judged, state_finding, weights_finding
from grading.problems import named_for
from grading.isolation.ranks import _frame

pytestmark = pytest.mark.problem("beyond")


CHILD_DEADLINE_S = 60.0  # a child takes well under a second; one that hangs fails the test here


def _read_child(allocate_mb: int, stop: bool = True) -> list[dict]:
    """Fork a process that pauses, allocates ``allocate_mb`` MB and keeps it in a global, pauses
    again and exits; the grader's readings of it.

    The child computes on one thread, as the grader's ranks do (ranks.py): this pytest worker may
    have run OpenMP regions on several threads already, and a forked child that enters one then
    waits forever for the parent's pool threads, which the fork did not copy."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no torch work beyond this
        os.close(reader)
        try:
            torch.set_num_threads(1)
            if not stop:
                os.kill = lambda *a: None  # a submission that patched the stop away
            outside.prepare_rank()
            outside.pause(writer, outside.BEFORE)
            globals()["kept"] = torch.ones(allocate_mb * MB // 4)
            outside.pause(writer, "after step 1")
        finally:
            os._exit(0)
    os.close(writer)
    buffer, readings = bytearray(), []
    deadline = time.monotonic() + CHILD_DEADLINE_S
    try:
        while True:
            if not select.select([reader], [], [], max(0.0, deadline - time.monotonic()))[0]:
                pytest.fail(f"the forked child wrote nothing for {CHILD_DEADLINE_S:.0f} s; its readings so far: {readings}")
            if not (chunk := os.read(reader, 1 << 16)):
                return readings
            buffer += chunk
            outside.take_pauses(buffer, pid, readings, _frame)
    finally:
        os.close(reader)
        if not os.waitpid(pid, os.WNOHANG)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_memory_a_process_keeps_is_read_from_outside():
    """8 MB kept in a module global between two pauses: the reading shows 8 MB (within 1 MB),
    and the child, stopped at each pause, went on to exit."""
    readings = _read_child(8)
    assert [r["label"] for r in readings] == [outside.BEFORE, "after step 1"], readings
    grown = readings[1]["bytes"] - readings[0]["bytes"]
    assert 8 * MB <= grown < 9 * MB, grown / MB


def test_a_process_that_does_not_stop_is_not_read(monkeypatch):
    """Its os.kill patched: the grader waits, then records the pause without a reading, and the
    check that needs it says so instead of passing."""
    monkeypatch.setattr(outside, "STOP_WAIT_S", 0.3)
    readings = _read_child(1, stop=False)
    assert readings and all("bytes" not in r for r in readings), readings
    found = state_finding([{"outside": readings}] * 2, 12 * MB, 6 * MB, "optimizer_state_sharding", "over")
    assert "did not stop at the grader's pause" in found and named_for("optimizer_state_sharding") in found


def test_a_memory_finding_stands_only_when_a_second_run_finds_it_whole():
    """No finding: no second run. A finding the second run does not repeat (a correct rank's
    outlier): none, but the second run's training is compared as the first's. One it repeats:
    the second run's, which the TA reads; and where the ranks' own tensors meet the requirement,
    the reading and they disagree: held for review with both, never a cap on one."""
    runs = []

    def again(found: str, mismatch: str = ""):
        return lambda: runs.append(found) or Run([], mismatch=mismatch, full_bytes=found)

    def finding(run):
        return run.full_bytes if isinstance(run.full_bytes, str) else ""

    agree = finding  # the ranks' own tensors find what the reading finds
    assert judged(Run([]), again("never"), finding, agree) == [] and runs == []
    assert judged(Run([], full_bytes="rank 1 holds 15.8 MB"), again(""), finding, agree) == ["", ""] and runs == [""]
    wrong = judged(Run([], full_bytes="rank 1 holds 15.8 MB"), again("", "step 1: wrong"), finding, agree)
    assert wrong == ["", "step 1: wrong"], wrong
    assert judged(Run([], full_bytes="rank 1 holds 18.9 MB"), again("rank 1 holds 18.8 MB"), finding, agree) == \
        ["rank 1 holds 18.8 MB", ""]
    disagree = judged(Run([], full_bytes="rank 1 holds 18.9 MB"), again("rank 1 holds 18.8 MB"), finding,
                      lambda run: "")
    assert review.is_held(disagree[1]) and "outside: rank 1 holds 18.8 MB" in disagree[1], disagree
    with pytest.raises(AssertionError, match="^step 2: wrong"):
        findings(*disagree, "step 2: wrong")  # wrong training fails whatever the witnesses say
    with pytest.raises(AssertionError, match=f"^{review.HELD}"):
        findings(*disagree)


def test_a_reading_within_its_bound_is_held_when_another_witness_disagrees():
    """Within its bound, a reading passes only when no other witness disagrees: the ranks' own
    tensors, a memory that fell below what it held once imported (pages given back), tensors
    the modules made at import, what its own code did as it ran (the audit hook's lines)."""
    fine = lambda run: ""  # noqa: E731
    reports = [_measured(1.4, [14.1, 14.1])] * 2
    assert judged(Run(reports), lambda: None, fine, fine) == []
    [held] = judged(Run(reports), lambda: None, fine, lambda run: "rank 0's optimizer reaches 12.0 MB of state")
    assert held.startswith(review.HELD) and "rank 0 holds 12.7 MB after its steps" in held, held
    given_back = [_measured(1.4, [0.2, 14.1])] * 2
    [held] = judged(Run(given_back), lambda: None, fine, fine)
    assert "fell to 400.2 MB (after step 1) below the 401.4 MB it held once imported" in held, held
    early = [{**_measured(8.0, [14.1]), "imported": 8 * MB, "imported_largest": "modules['a']['POOL'] → tensor"}] * 2
    [held] = judged(Run(early), lambda: None, fine, fine)
    assert "modules hold 8.0 MB of tensors and buffers once imported" in held, held
    constant = [{**early[0], "imported_changed": []}] * 2  # made at import and never written to: a constant mask
    assert judged(Run(constant), lambda: None, fine, fine) == []
    written = [{**early[0], "imported_changed": ["modules['a']['POOL']"]}] * 2
    [held] = judged(Run(written), lambda: None, fine, fine)
    assert "written to since: modules['a']['POOL']" in held, held
    witnessed = [{**reports[0], review.KEY: ["tests/adapters.py:3: maps memory (mmap)"]}, reports[1]]
    [held] = judged(Run(witnessed), lambda: None, fine, fine)
    assert "rank 0: tests/adapters.py:3: maps memory (mmap)" in held, held


def _report(base: int, **held_mb: list[float]) -> dict:
    """A rank's readings: ``after_step=[...]`` and ``between=[...]`` in MB held above ``base``."""
    readings = [{"label": outside.BEFORE, "bytes": base}]
    after, between = held_mb.get("after_step", []), held_mb.get("between", [])
    for step in range(1, max(len(after), len(between)) + 1):
        if step <= len(between):
            readings.append({"label": f"between forward and backward of step {step}", "bytes": base + int(between[step - 1] * MB)})
        if step <= len(after):
            readings.append({"label": f"after step {step}", "bytes": base + int(after[step - 1] * MB)})
    return {"outside": readings, "hint": ["optimizer.local.state → tensor 512×512 float32 (1048576 bytes)"]}


ZERO = "optimizer_state_sharding"
STATE, MODEL = 12 * MB, 6 * MB  # AdamW of the measured model (6 layers of 512×512), and the model


@pytest.mark.parametrize("world_size, correct, weak", [
    (2, [12.40, 12.44, 12.43], [18.38, 18.43, 18.44]),  # sharded: 6 MB of state; unsharded: 12
    (3, [10.43, 10.45, 10.49], [18.37, 18.38, 18.38]),
])
def test_state_over_its_share_is_not_sharded(world_size, correct, weak):
    """The fixture's readings (model + state) pass; every rank keeping the whole state fails, with
    the megabytes against the bound and the in-rank hint labelled as such."""
    assert state_finding([_report(400 * MB, after_step=correct)] * world_size, STATE, MODEL, ZERO, "over") == ""
    found = state_finding([_report(400 * MB, after_step=weak)] * world_size, STATE, MODEL, ZERO, "over")
    assert found.startswith(f"rank 0 holds {weak[0] - 6:.1f} MB beyond the model's 6.0 MB at every pause") and \
        "the optimizer state is not sharded" in found and named_for(ZERO) in found and "[hint, counted inside the rank" in found


def test_a_rank_without_a_share_is_found():
    """A partition written for 2 ranks at world size 3 (rank 2 keeps 0.4 MB beyond the model,
    the others half the state each): the floor finds rank 2; the upper bound alone would pass."""
    reports = [_report(400 * MB, after_step=[12.43, 12.45, 12.47])] * 2 + [_report(400 * MB, after_step=[6.36, 6.38, 6.39])]
    assert state_finding(reports, STATE, MODEL, ZERO, "over") == ""
    found = state_finding(reports, STATE, MODEL, ZERO, "under")
    assert found.startswith("rank 2 holds at most 0.4 MB beyond the model") and "given no share" in found
    correct = [_report(400 * MB, after_step=[10.43, 10.45, 10.49])] * 3
    assert state_finding(correct, STATE, MODEL, ZERO, "under") == ""


FSDP = "fsdp"
WEIGHTS = {name: 6 * MB for name in ("embedding.weight", "up.weight", "down.weight", "lm_head.weight")}


@pytest.mark.parametrize("world_size, correct, one_whole", [(2, 13.3, 16.25), (3, 9.0, 12.95)])
def test_one_weight_kept_whole_is_found(world_size, correct, one_whole):
    """Between steps the fixture holds its shards and 1.0 to 1.3 MB more (the most seen in 10 runs
    under load: 13.31 MB at 2 ranks, 9.00 at 3); an FSDP that leaves one weight (the embedding,
    say) whole holds w·(1 - 1/ws) more, and is found; so is one keeping all."""
    ok = [_report(400 * MB, after_step=[correct, correct + 0.02])] * world_size
    assert weights_finding(ok, WEIGHTS, 0, FSDP) == ""
    weak = [_report(400 * MB, after_step=[one_whole, one_whole])] * world_size
    found = weights_finding(weak, WEIGHTS, 0, FSDP)
    assert found.startswith(f"rank 0 holds {one_whole:.1f} MB between steps") and "weights are not sharded" in found
    assert f"kept whole adds {6 * (1 - 1 / world_size):.1f} MB" in found and named_for(FSDP) in found
    everything = weights_finding([_report(400 * MB, after_step=[25.3, 25.3])] * world_size, WEIGHTS, 0, FSDP)
    assert everything.startswith("rank 0 holds 25.3 MB between steps")


def test_gathered_weights_kept_until_backward_are_found():
    """An FSDP that keeps three gathered weights (autograd saved them) between forward and
    backward, as the old fixture did: 20.7 MB beyond the step before, 18 MB beyond the activations,
    found with the handout's words first; an FSDP that gathers again in backward keeps one in
    flight at most, and passes; step 1's pause is not judged (step 1 may make what later steps keep)."""
    activations = int(2.67 * MB)
    kept = [_report(400 * MB, after_step=[13.26, 13.27], between=[33.13, 33.95])] * 2
    found = freed_finding(kept, WEIGHTS, activations, FSDP)
    assert found.startswith(FREED_HANDOUT + ": rank 0 holds 20.7 MB more between forward and backward"), found
    assert "about 3.0 gathered" in found
    prefetching = [_report(400 * MB, after_step=[13.3, 13.3], between=[30.0, 13.3 + 2.7 + 6.2])] * 2
    assert freed_finding(prefetching, WEIGHTS, activations, FSDP) == ""


def test_a_pause_missing_or_out_of_order_is_a_finding():
    """Readings without the first pause, or with none after a step, are not judged as small, nor
    are pauses the suite does not make: an "after step 0" sent by the submission's code before
    any state exists (it was read as the least, 15/15 for an unsharded optimizer), a step's pause
    twice, or out of order."""
    no_base = {"outside": [{"label": "after step 1", "bytes": 1}]}
    assert "pause frames the suite does not make (after step 1)" in state_finding([no_base] * 2, STATE, MODEL, ZERO, "under")
    assert "not the ones the suite makes" in weights_finding([{"outside": []}] * 2, WEIGHTS, 0, FSDP)
    honest = _measured(1.4, [14.1, 14.1, 14.1])
    for forged in ("after step 0", "after step 2"):
        readings = honest["outside"][:2] + [{"label": forged, "bytes": 400 * MB}] + honest["outside"][2:]
        assert "pause frames the suite does not make" in state_finding([{"outside": readings}] * 2, STATE, MODEL, ZERO, "over")


def test_sigstop_cannot_be_caught():
    """The pause relies on it: a handler for SIGSTOP cannot be installed."""
    with pytest.raises((OSError, RuntimeError, ValueError)):
        signal.signal(signal.SIGSTOP, lambda *a: None)


def _start_up(ctx, job) -> dict:
    """Rank side: what a rank's start-up left that its code could see."""
    import gc

    return {"frozen": gc.get_freeze_count()}


def test_every_rank_starts_alike():
    """Point tests are not told apart by their start-up: every rank of every test has the
    collector's permanent generation filled (the measured tests' collection relies on it), not
    only the measured ones; and a rank that never pauses reports no reading."""
    from grading.isolation import wire
    from grading.isolation.ranks import run_ranks

    reports = run_ranks(_start_up, 2, [wire.encode({})] * 2, timeout_s=60)
    assert all(r["frozen"] > 10_000 and r[outside.KEY] == [] for r in reports), reports


def _measured(imported_mb: float, after_step: list[float], source: str = "cgroup v1") -> dict:
    """A measured rank's readings (MB above its first pause), its import's pause included."""
    readings = [{"label": outside.BEFORE, "bytes": 400 * MB, "source": source},
                {"label": outside.IMPORTED, "bytes": 400 * MB + int(imported_mb * MB), "source": source}]
    readings += [{"label": f"after step {s}", "bytes": 400 * MB + int(b * MB), "source": source}
                 for s, b in enumerate(after_step, 1)]
    return {"outside": readings}


def test_state_is_judged_beyond_the_graders_own_ranks_and_the_import():
    """Measured with a cgroup per rank (this machine, the answers at 2 ranks): the grader's own
    ranks hold 6.4 MB (the model and 0.4 MB of buffers), the answers' import 1.4 MB, each rank
    14.1 MB: 6.3 MB of state, under the 9.0 MB bound. The unsharded optimizer is found. What the
    import holds is never counted, however large (a plotting library's 25 MB): a buffer a module
    made then is a witness for review instead (test above)."""
    calibration = [{"outside": [{"label": outside.BEFORE, "bytes": 300 * MB}] +
                    [{"label": f"after step {s}", "bytes": 300 * MB + int(6.4 * MB)} for s in (1, 2, 3)]}] * 2
    correct = [_measured(1.4, [14.06, 14.1, 14.1])] * 2
    assert state_finding(correct, STATE, MODEL, ZERO, "over", calibration) == ""
    plotting = [_measured(25.0, [37.66, 37.7, 37.7])] * 2
    assert state_finding(plotting, STATE, MODEL, ZERO, "over", calibration) == ""
    unsharded = state_finding([_measured(1.4, [20.1, 20.1, 20.1])] * 2, STATE, MODEL, ZERO, "over", calibration)
    assert unsharded.startswith("rank 0 holds 12.3 MB beyond the 6.4 MB the grader's own training holds there"), unsharded
    assert "its memory cgroup's charge, cgroup v1" in unsharded
    unread = state_finding(correct, STATE, MODEL, ZERO, "over", [{"outside": []}] * 2)
    assert unread.startswith("grader error, not the submission's"), unread


def test_fsdp_allowance_is_what_the_graders_plain_model_keeps():
    """The grader's plain model keeps 1.4 MB beyond its 24 MB of weights (measured, 2 ranks): a
    correct rank at 15.2 MB (import 1.4) passes, one weight kept whole (3 MB more) fails, and the
    allowance never drops below TRAINING_KEEPS where the plain model keeps less."""
    full = sum(WEIGHTS.values())
    plain = [{"outside": [{"label": outside.BEFORE, "bytes": 300 * MB}] +
              [{"label": f"after step {s}", "bytes": 300 * MB + full + int(1.4 * MB)} for s in (1, 2)]}] * 2
    assert weights_finding([_measured(1.4, [15.2, 15.2])] * 2, WEIGHTS, 0, FSDP, plain) == ""
    found = weights_finding([_measured(1.4, [18.2, 18.2])] * 2, WEIGHTS, 0, FSDP, plain)
    assert found.startswith("rank 0 holds 16.8 MB between steps") and "+ 1.4 MB the training keeps" in found, found
    lean = [{"outside": [{"label": outside.BEFORE, "bytes": 300 * MB}] +
             [{"label": f"after step {s}", "bytes": 300 * MB + full} for s in (1, 2)]}] * 2
    assert "+ 1.2 MB the training keeps" in weights_finding([_measured(1.4, [18.2, 18.2])] * 2, WEIGHTS, 0, FSDP, lean)


def _grader_rank_that_fails(ctx, job) -> dict:
    raise RuntimeError("out of memory, say")


def test_a_calibration_that_fails_is_the_graders_failure():
    """The grader's own ranks run no submission code: when they fail, the test fails as a grader
    failure (the grading stops with no grade written), never as the submission's."""
    from grading.isolation import wire
    from grading.readings.memory import calibrated
    from grading.selfcheck import GRADER_FAILURE

    with pytest.raises(pytest.fail.Exception, match=f"^{GRADER_FAILURE}the grader's own ranks.*out of memory, say"):
        calibrated(_grader_rank_that_fails, 2, [wire.encode({})] * 2)
