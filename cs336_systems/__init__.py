"""Distributed data-parallel training from scratch (CS336 assignment 2, section 2)."""
