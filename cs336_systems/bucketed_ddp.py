"""Moved to cs336_systems.ddp (kept until adapters.py is updated by the layout change)."""
from cs336_systems.ddp.bucketed import BucketedDDP  # noqa: F401
