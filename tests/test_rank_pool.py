"""The rank pool runs many cases over one process group, and a failing case ends alone.

Each failure mode (a rank that raises, one that hangs, one that is killed) must end that case
with a message that names the rank and what happened, within the case's deadline, and the pool
must run the next case correctly on ranks spawned afresh. The pools here are the test's own, not
the shared ones of tests/rank_pool.py, so a failure staged here never costs another test its ranks.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from cs336_systems.launch import RankContext, RankFailedError
from cs336_systems.launch.pool import RankPool

pytestmark = [pytest.mark.problem("beyond"), pytest.mark.timeout(300)]

_calls = 0  # per rank process: how many cases this process has run


def summed_rank(ctx: RankContext, offset: float) -> dict:
    """An all-reduce of (rank + offset): the sum every rank must see, with this process's identity."""
    global _calls
    _calls += 1
    value = torch.tensor([ctx.rank + offset])
    dist.all_reduce(value)
    return {"sum": value.item(), "pid": os.getpid(), "calls": _calls, "world_size": ctx.world_size}


def check_sums(results: list[dict], world_size: int, offset: float) -> None:
    expected = sum(range(world_size)) + world_size * offset
    assert [r["sum"] for r in results] == [expected] * world_size


def raise_on_rank_1(ctx: RankContext) -> None:
    if ctx.rank == 1:
        raise ValueError("staged failure on rank 1")
    dist.barrier()  # rank 0 waits in a collective rank 1 never joins


def hang_on_rank_1(ctx: RankContext) -> None:
    if ctx.rank == 1:
        while True:
            time.sleep(1)
    dist.barrier()


def kill_rank_1(ctx: RankContext) -> None:
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@pytest.fixture
def pool():
    pool = RankPool(2, backend="gloo", device_type="cpu", timeout_s=60)
    yield pool
    pool.close()


def test_many_cases_run_in_one_spawn_and_one_group(pool: RankPool):
    """Twenty cases, one spawn: the same two processes answer every case, each case's collective is right."""
    pids = None
    for case in range(20):
        results = pool.run(summed_rank, (float(case),))
        check_sums(results, 2, float(case))
        assert [r["calls"] for r in results] == [case + 1] * 2
        pids = pids or [r["pid"] for r in results]
        assert [r["pid"] for r in results] == pids == pool.pids
    assert pool.spawns == 1


@pytest.mark.parametrize("fn,error,words", [
    (raise_on_rank_1, RankFailedError, ("rank1 raised", "ValueError: staged failure on rank 1", "raise_on_rank_1")),
    (kill_rank_1, RankFailedError, ("rank1 killed by SIGKILL", "kill_rank_1")),
    (hang_on_rank_1, TimeoutError, ("rank0, rank1 of 2 ranks had not finished hang_on_rank_1",)),
], ids=["raises", "killed", "hangs"])
def test_a_failing_case_ends_alone_with_its_message_and_the_next_case_runs(pool, fn, error, words):
    before = pool.run(summed_rank, (0.5,))
    start = time.monotonic()
    with pytest.raises(error) as failure:
        pool.run(fn, deadline_s=15)
    # A raise or a death ends the case at once (the peer, stuck in its barrier, gets a 2 s grace
    # to report); a hang at its deadline. Never the group's 60 s timeout.
    assert time.monotonic() - start < 15 + 10
    for word in words:
        assert word in str(failure.value), str(failure.value)
    after = pool.run(summed_rank, (1.5,))
    check_sums(after, 2, 1.5)
    assert pool.spawns == 2
    assert {r["pid"] for r in after}.isdisjoint(r["pid"] for r in before)
    assert [r["calls"] for r in after] == [1, 1]  # fresh processes: no state of the failed case


def test_ranks_are_gone_after_a_failure_and_after_close():
    pool = RankPool(2, backend="gloo", device_type="cpu", timeout_s=60)
    pool.run(summed_rank, (0.0,))
    processes = list(pool.processes)
    with pytest.raises(RankFailedError):
        pool.run(raise_on_rank_1, deadline_s=15)
    assert not any(p.is_alive() for p in processes)
    pool.run(summed_rank, (0.0,))
    processes = list(pool.processes)
    pool.close()
    assert [p.exitcode for p in processes] == [0, 0]  # left the group together, exited cleanly


def test_three_ranks_and_the_world_size_checked_before_any_spawn():
    pool = RankPool(3, backend="gloo", device_type="cpu")
    try:
        results = pool.run(summed_rank, (2.0,))
        check_sums(results, 3, 2.0)
        assert {r["world_size"] for r in results} == {3}
    finally:
        pool.close()
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        RankPool(0)
