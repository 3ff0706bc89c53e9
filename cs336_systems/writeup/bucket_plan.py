"""The buckets a bucketed run built (its record's ``bucket_bytes`` and ``bucket_params``, in launch
order), and with the model's shapes (built on the meta device, allocating nothing) why a cap above
all gradients still builds two buckets.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cs336_basics.model import TransformerLM
from cs336_systems.bench.allreduce.setting import FLOAT32_BYTES
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.writeup.step_setting import config_of

SHOWN_NAMES = 3  # parameters named per bucket before the rest are counted


def parameter_shapes(setting: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the run's model ({} if the size is unknown here)."""
    config = config_of(setting)
    if config is None:
        return {}
    with torch.device("meta"):
        model = TransformerLM(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def buckets(r: StepRecord) -> list[dict[str, Any]]:
    """Each bucket in launch order: payload bytes, parameter count, the first few names."""
    return [dict(bytes=b, count=len(names), names=names[:SHOWN_NAMES])
            for names, b in zip(r.bucket_params or [], r.bucket_bytes or [])]


def large_cap(sweep: list[StepRecord], s_bytes: float | None, shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """The caps that hold all ``s_bytes`` yet built more than one bucket, and why: the first bucket's own
    cap (``first_bucket_mb``) and whether the first gradient alone exceeds it; None if no cap does."""
    large = [r for r in sweep if s_bytes and r.bucket_cap_bytes is not None and r.bucket_cap_bytes >= s_bytes
             and (r.n_buckets or 0) > 1 and r.bucket_params and r.bucket_bytes]
    if not large:
        return None
    r = large[0]
    first = r.bucket_params[0] if r.bucket_params else []
    first_bytes = FLOAT32_BYTES * math.prod(shapes[first[0]]) if len(first) == 1 and first[0] in shapes else None
    # Caps that hold every gradient all build the same plan (the first bucket, then the rest): their
    # step times differ only by noise.
    same_plan = len(large) > 1 and all(x.bucket_bytes == r.bucket_bytes for x in large)
    return dict(caps=[x.bucket_size_mb for x in large], counts=sorted({x.n_buckets for x in large}), record=r,
                records=large, same_plan=same_plan,
                first_cap=r.first_bucket_cap_bytes, first=first[0] if len(first) == 1 else None,
                first_shape=shapes.get(first[0]) if first_bytes else None, first_bytes=first_bytes)
