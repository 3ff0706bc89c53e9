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


@pytest.fixture(scope="module")
def pool():
    """One pool for the module's 2-rank tests: each failure staged here costs it one respawn."""
    pool = RankPool(2, backend="gloo", device_type="cpu", timeout_s=60)
    yield pool
    pool.close()


def test_many_cases_run_in_one_spawn_and_one_group(pool: RankPool):
    """Twenty cases, no spawn between them: the same two processes answer every case, each case's collective is right."""
    first = pool.run(summed_rank, (0.0,))
    spawns, pids, calls = pool.spawns, [r["pid"] for r in first], first[0]["calls"]
    for case in range(1, 20):
        results = pool.run(summed_rank, (float(case),))
        check_sums(results, 2, float(case))
        assert [r["calls"] for r in results] == [calls + case] * 2
        assert [r["pid"] for r in results] == pids == pool.pids
    assert pool.spawns == spawns


@pytest.mark.parametrize("fn,error,words", [
    (raise_on_rank_1, RankFailedError, ("rank1 raised", "ValueError: staged failure on rank 1", "raise_on_rank_1")),
    (kill_rank_1, RankFailedError, ("rank1 killed by SIGKILL", "kill_rank_1")),
    (hang_on_rank_1, TimeoutError, ("rank0, rank1 of 2 ranks had not finished hang_on_rank_1",)),
], ids=["raises", "killed", "hangs"])
def test_a_failing_case_ends_alone_with_its_message_and_the_next_case_runs(pool, fn, error, words):
    before = pool.run(summed_rank, (0.5,))
    spawns, processes = pool.spawns, list(pool.processes)
    start = time.monotonic()
    with pytest.raises(error) as failure:
        pool.run(fn, deadline_s=15)
    # A raise or a death ends the case at once (the peer, stuck in its barrier, gets a 2 s grace
    # to report); a hang at its deadline. Never the group's 60 s timeout.
    assert time.monotonic() - start < 15 + 10
    for word in words:
        assert word in str(failure.value), str(failure.value)
    assert not any(p.is_alive() for p in processes)  # every rank of the failed case was stopped
    after = pool.run(summed_rank, (1.5,))
    check_sums(after, 2, 1.5)
    assert pool.spawns == spawns + 1
    assert {r["pid"] for r in after}.isdisjoint(r["pid"] for r in before)
    assert [r["calls"] for r in after] == [1, 1]  # fresh processes: no state of the failed case


def test_ranks_leave_the_group_together_at_close(pool):
    pool.run(summed_rank, (0.0,))
    processes = list(pool.processes)
    pool.close()
    assert [p.exitcode for p in processes] == [0, 0]  # left the group together, exited cleanly
    assert pool.processes == []
    check_sums(pool.run(summed_rank, (3.0,)), 2, 3.0)  # a closed pool spawns again when asked


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
