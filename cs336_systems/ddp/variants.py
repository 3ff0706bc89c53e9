"""The registry of DDP variants: one name, one builder and one handout problem each.

Adapters, the step benchmark, the profiler, the equivalence check and the tests all look
variants up here, so a variant is named the same way everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from cs336_systems.ddp.auto_bucket import AUTO, AutoBucketedDDP
from cs336_systems.ddp.base import DataParallel
from cs336_systems.ddp.bucketed import DEFAULT_BUCKET_MB, BucketedDDP
from cs336_systems.ddp.flat import FlatDDP
from cs336_systems.ddp.naive import NaiveDDP
from cs336_systems.ddp.per_parameter import PerParameterDDP


def bucketed(module: nn.Module, bucket_size_mb: float | str | None = DEFAULT_BUCKET_MB, **options: Any) -> DataParallel:
    """:class:`BucketedDDP`, or :class:`AutoBucketedDDP` for ``bucket_size_mb="auto"``."""
    if isinstance(bucket_size_mb, str) and bucket_size_mb == AUTO:
        return AutoBucketedDDP(module, **options)
    return BucketedDDP(module, bucket_size_mb, **options)  # refuses any other string


@dataclass(frozen=True)
class Variant:
    """One DDP variant of this repo."""

    name: str  # the name every table, flag and test uses
    build: Callable[..., DataParallel]  # (module, **options) -> the wrapper
    overlapped: bool  # communication starts during backward
    problem: str  # the handout problem that asks for it

    def wrap(self, module: nn.Module, **options: Any) -> DataParallel:
        return self.build(module, **options)


NAIVE = Variant("naive", NaiveDDP, False, "naive_ddp")
FLAT = Variant("flat", FlatDDP, False, "minimal_ddp_flat_benchmarking")
PER_PARAMETER = Variant("per-parameter", PerParameterDDP, True, "ddp_overlap_individual_parameters")
BUCKETED = Variant("bucketed", bucketed, True, "ddp_overlap_bucketed")
VARIANTS: dict[str, Variant] = {v.name: v for v in (NAIVE, FLAT, PER_PARAMETER, BUCKETED)}


def variant(name: str) -> Variant:
    """The variant called ``name``; ValueError naming the known ones otherwise."""
    if name not in VARIANTS:
        raise ValueError(f"unknown DDP variant {name!r}; known: {', '.join(VARIANTS)}")
    return VARIANTS[name]
