"""The test processes' rank pools: one per world size in each pytest process (each xdist worker).

Tests run their multi-rank cases with ``on_pool(fn, world_size, args)`` where they would call
``launch(fn, world_size, args)``: the ranks are spawned, and join their group, once per worker
rather than once per test file or case (cs336_systems/launch/pool.py). A case that fails costs the
pool its ranks and the next case spawns new ones, so a test that expects its ranks to fail (or one
whose ranks need a fresh process, or other environment variables) calls ``launch``. Only 2- and 3-rank
pools are kept (10 processes for two workers); larger jobs spawn. The pools are closed at the end
of the session (tests/conftest.py), or when this process exits.
"""

from __future__ import annotations

import atexit

from cs336_systems.launch.pool import RankPool

_pools: dict[int, RankPool] = {}
POOLED_WORLD_SIZES = (2, 3)
# The group's collective timeout, the longest any pooled case asked launch for; each case's own
# deadline (3 x its timeout_s, as launch's) ends a hung case well before the suite's.
GROUP_TIMEOUT_S = 300.0


def rank_pool(world_size: int) -> RankPool:
    """This process's pool of ``world_size`` CPU ranks on gloo, spawned at its first case."""
    if world_size not in POOLED_WORLD_SIZES:
        raise ValueError(f"pools hold {POOLED_WORLD_SIZES} ranks, not {world_size}: launch() a larger job")
    if world_size not in _pools:
        _pools[world_size] = RankPool(world_size, backend="gloo", device_type="cpu", timeout_s=GROUP_TIMEOUT_S)
    return _pools[world_size]


def on_pool(fn, world_size: int, args=(), timeout_s: float = 120.0) -> list:
    """``launch(fn, world_size, args, timeout_s=...)`` on this process's pool: each rank's result."""
    return rank_pool(world_size).run(fn, args, deadline_s=3 * timeout_s)


def close_pools() -> None:
    while _pools:
        _pools.popitem()[1].close()


atexit.register(close_pools)
