"""Collective helpers that more than one technique uses (DDP, the sharded optimizer, FSDP)."""
