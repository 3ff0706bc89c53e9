"""Moved to cs336_systems.launch (kept until the FSDP tests import from there)."""
from cs336_systems.launch import *  # noqa: F401,F403
