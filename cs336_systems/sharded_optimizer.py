"""Moved: the sharded optimizer lives in :mod:`cs336_systems.zero`; this name stays for adapters.py."""

from cs336_systems.zero import ShardedOptimizer  # noqa: F401
