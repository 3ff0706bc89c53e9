"""The step benchmark's variant names, and building each one around the shared module.

* ``compute-only``: the bare module, no communication: the floor no DDP can beat;
* ``naive``, ``flat``, ``per-parameter``: this repo's wrappers, looked up by name in
  :data:`cs336_systems.ddp.VARIANTS` (the one registry of DDP variants);
* ``bucketed-<N>MB``: :class:`~cs336_systems.ddp.BucketedDDP` with ``bucket_size_mb=N``; a
  suffix switches one lever off (``-copy``: gradients copied instead of viewed, ``-no-first``:
  no small first bucket, ``-no-reorder``: no rebuild in ready order, ``-plain``: all three off)
  or communicates in bfloat16 (``-bf16``); ``bucketed-auto`` lets the overhead model choose N;
* ``torch-ddp``: ``torch.nn.parallel.DistributedDataParallel`` at its defaults.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cs336_systems import cli
from cs336_systems.bench.step.probes import CopyProbe
from cs336_systems.ddp import AutoBucketedDDP, BucketedDDP, DataParallel
from cs336_systems.ddp.variants import BUCKETED, FLAT as FLAT_VARIANT, VARIANTS
from cs336_systems.launch import RankContext

COMPUTE_ONLY = "compute-only"
TORCH_DDP = "torch-ddp"
FLAT = FLAT_VARIANT.name  # the variant whose copies are timed beside its steps (probes.py)
BUCKETED_PREFIX = BUCKETED.name + "-"
AUTO = "auto"
# Registry variants timed under their own name; the bucketed one needs a size in its name.
PLAIN_VARIANTS = tuple(name for name in VARIANTS if name != BUCKETED.name)

# Suffixes of a bucketed variant's name that switch one lever of BucketedDDP off (or bf16 on).
LEVER_SUFFIXES: dict[str, dict[str, Any]] = {
    "-copy": {"gradient_as_bucket_view": False},
    "-no-first": {"first_bucket_mb": None},
    "-no-reorder": {"reorder_after_first_step": False},
    "-plain": {"gradient_as_bucket_view": False, "first_bucket_mb": None, "reorder_after_first_step": False},
    "-bf16": {"comm_dtype": torch.bfloat16},
}
# The ablation: every lever on, each one off, all off, bf16 communication; torch DDP beside.
ABLATION_VARIANTS = (
    COMPUTE_ONLY,
    "per-parameter",
    "bucketed-25MB-plain",
    "bucketed-25MB-copy",
    "bucketed-25MB-no-first",
    "bucketed-25MB-no-reorder",
    "bucketed-25MB",
    "bucketed-25MB-bf16",
    "bucketed-auto",
    TORCH_DDP,
)
NAME_FORMS = (f"{COMPUTE_ONLY}, {', '.join(PLAIN_VARIANTS)}, {TORCH_DDP}, "
              f"bucketed-<N>MB[{'|'.join(LEVER_SUFFIXES)}] (N > 0) or bucketed-{AUTO}")


def planned_layouts(model: nn.Module, bucket_sizes_mb: tuple[float, ...]) -> dict[float, list[int]]:
    """Each bucket size's layout as BucketedDDP builds it at its defaults for ``model`` before the
    first step (a meta-device model will do): the bytes of each bucket, in launch order. Two sizes
    of one sweep with the same layout would time one thing twice."""
    from cs336_systems.ddp.bucket import bucket_cap_bytes
    from cs336_systems.ddp.bucketed import BucketLayout

    first_mb = inspect.signature(BucketedDDP.__init__).parameters["first_bucket_mb"].default
    params = [p for p in model.parameters() if p.requires_grad]
    launch_order = list(reversed(params))  # OverlappedDataParallel's order before any rebuild
    layouts = {}
    for mb in bucket_sizes_mb:
        layout = BucketLayout(bucket_cap_bytes(mb), bucket_cap_bytes(first_mb), None, True)
        layouts[mb] = [sum(launch_order[i].numel() * launch_order[i].element_size() for i in bucket)
                       for bucket in layout.plan(launch_order)]
    return layouts


def bucketed_name(bucket_size_mb: float) -> str:
    """The name of the bucketed variant with a cap of ``bucket_size_mb``: "bucketed-25MB"."""
    return f"{BUCKETED_PREFIX}{bucket_size_mb:g}MB"


def parse_bucketed(name: str) -> tuple[float | str, dict[str, Any]]:
    """``bucketed-<N>MB[<suffix>]`` -> (N, BucketedDDP keyword arguments); ``bucketed-auto`` ->
    ("auto", {}); ValueError for anything else."""
    if not name.startswith(BUCKETED_PREFIX):
        raise ValueError(f"unknown variant {name!r}: expected one of {NAME_FORMS}")
    rest = name.removeprefix(BUCKETED_PREFIX)
    if rest == AUTO:
        return AUTO, {}
    options: dict[str, Any] = {}
    for suffix, lever in LEVER_SUFFIXES.items():
        if rest.endswith(suffix):
            rest = rest.removesuffix(suffix)
            options.update(lever)
            break
    try:
        size = float(rest.removesuffix("MB")) if rest.endswith("MB") else math.nan
    except ValueError:
        size = math.nan
    if not (math.isfinite(size) and size > 0):
        raise ValueError(f"unknown variant {name!r}: expected one of {NAME_FORMS}")
    return size, options


def communication_dtype(name: str) -> torch.dtype | None:
    """The narrower dtype a variant communicates in (``-bf16``), None for full width."""
    if not name.startswith(BUCKETED_PREFIX):
        return None
    return parse_bucketed(name)[1].get("comm_dtype")


def check_variant_name(name: str) -> str:
    """``name`` if the benchmark knows it; ValueError naming the known forms otherwise."""
    if name not in (COMPUTE_ONLY, TORCH_DDP, *PLAIN_VARIANTS):
        parse_bucketed(name)
    return name


def bucket_size_of(name: str) -> float | None:
    """The cap (MB) a bucketed variant's name asks for; None for other variants and "auto"."""
    if not name.startswith(BUCKETED_PREFIX):
        return None
    size, _ = parse_bucketed(name)
    return None if size == AUTO else float(size)


@dataclass(frozen=True)
class VariantName(cli.Check):
    """``--variants``: a name of the forms above."""

    allowed: str = NAME_FORMS
    bad_values: tuple[str, ...] = ("no-such-variant", "bucketed-0MB", "bucketed-xMB", "bucketed-10MB-fast")

    def parse(self, text: str) -> str:
        try:
            return check_variant_name(text)
        except ValueError:
            raise self.refuse(text) from None


@dataclass
class StepVariant:
    """A variant as run: what forward is called on, and our wrapper if it is one of ours."""

    name: str
    model: nn.Module
    wrapper: DataParallel | None = None  # None for compute-only and torch DDP
    copy_probe: CopyProbe | None = None  # flat: its pack and unpack, timed after each step

    @property
    def finish(self) -> Callable[[], None] | None:
        """The synchronisation step after backward (None where there is none)."""
        return self.wrapper.finish_gradient_synchronization if self.wrapper is not None else None


def build_variant(name: str, module: nn.Module, ctx: RankContext) -> StepVariant:
    """Variant ``name`` around ``module`` (collective: every rank builds the same variants in order)."""
    if name == COMPUTE_ONLY:
        return StepVariant(name, module)
    if name == TORCH_DDP:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return StepVariant(name, DistributedDataParallel(module, device_ids=device_ids))
    if name in PLAIN_VARIANTS:
        wrapper = VARIANTS[name].wrap(module)
        if name == FLAT:
            return StepVariant(name, wrapper, wrapper, CopyProbe(wrapper.synced_params, ctx.world_size))
    else:
        size, options = parse_bucketed(name)
        wrapper = (AutoBucketedDDP(module, **options) if size == AUTO
                   else BucketedDDP(module, bucket_size_mb=size, **options))
    return StepVariant(name, wrapper, wrapper)
