"""Moved to cs336_systems.ddp (kept until adapters.py is updated by the layout change)."""
from cs336_systems.ddp.per_parameter import PerParameterDDP as DDPIndividualParameters  # noqa: F401
