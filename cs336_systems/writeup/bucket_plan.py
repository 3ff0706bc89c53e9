"""The buckets a bucketed run actually built, in words: which parameters, how many bytes, and why.

A bucketed :class:`~cs336_systems.bench.step.record.StepRecord` stores each bucket's payload
(``bucket_bytes``) and parameter names (``bucket_params``) in launch order, and the caps it used.
From them, and from the model's parameter shapes (:mod:`cs336_basics.model` on the meta device,
which allocates nothing), this module explains the plan: why a cap above all gradients still
gives two buckets, and what the first-bucket lever changes for this model. Counterfactual plans
are computed with the wrapper's own planner (:func:`cs336_systems.ddp.bucket.plan_buckets`) on
meta tensors in the recorded launch order.
"""

from __future__ import annotations

from typing import Any

import torch

from cs336_basics.model import TransformerLM
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.ddp.bucket import plan_buckets
from cs336_systems.units import MB
from cs336_systems.writeup import fmt
from cs336_systems.writeup.paired import listed
from cs336_systems.writeup.step_setting import GRADIENT_BYTES, config_of

# What a reader calls the parameters whose role the name alone does not say.
ROLES = {"lm_head.weight": "the output layer", "token_embeddings.weight": "the token embedding"}
SHOWN_NAMES = 4  # parameters named in a bucket before the rest are counted


def parameter_shapes(setting: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the run's model ({} if the size is unknown here)."""
    config = config_of(setting)
    if config is None:
        return {}
    with torch.device("meta"):
        model = TransformerLM(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def gradient_bytes(name: str, shapes: dict[str, tuple[int, ...]]) -> int:
    numel = 1
    for n in shapes[name]:
        numel *= n
    return GRADIENT_BYTES * numel


def label(name: str, shapes: dict[str, tuple[int, ...]]) -> str:
    """"`lm_head.weight` (the output layer, 10000 × 512, 19.5 MB)"."""
    parts = [ROLES[name]] if name in ROLES else []
    if name in shapes:
        parts += [" × ".join(str(n) for n in shapes[name]), f"{fmt.mb(gradient_bytes(name, shapes))} MB"]
    return f"`{name}`" + (f" ({', '.join(parts)})" if parts else "")


def bucket_text(names: list[str], payload: int, shapes: dict[str, tuple[int, ...]]) -> str:
    """One bucket: its payload and what it holds."""
    if len(names) == 1:
        return f"{fmt.mb(payload)} MB holding {label(names[0], shapes)} alone"
    shown = [f"`{n}`" for n in names[:SHOWN_NAMES]]
    rest = len(names) - len(shown)
    return f"{fmt.mb(payload)} MB holding {len(names)} parameters ({', '.join(shown)}" + (
        f" and {rest} more)" if rest else ")")


def plan_text(r: StepRecord, shapes: dict[str, tuple[int, ...]]) -> str:
    """"bucketed-100MB built 2 buckets, in launch order: 19.5 MB holding ... alone, then 67.1 MB holding ..."."""
    if not r.bucket_params or not r.bucket_bytes:
        return f"{r.variant} recorded no bucket layout."
    buckets = [bucket_text(names, payload, shapes) for names, payload in zip(r.bucket_params, r.bucket_bytes)]
    if len(buckets) > 3:
        largest = max(range(len(buckets)), key=lambda i: r.bucket_bytes[i])  # type: ignore[index]
        first = f"the first{', also the largest,' if largest == 0 else ''} is {buckets[0]}"
        middle = "" if largest in (0, len(buckets) - 1) else f", the largest (number {largest + 1}) {buckets[largest]}"
        return f"{r.variant} built {len(buckets)} buckets; {first}{middle}, the last {buckets[-1]}."
    return f"{r.variant} built {len(buckets)} bucket{'s' if len(buckets) != 1 else ''}, in launch order: " + \
        ", then ".join(buckets) + "."


def replan(r: StepRecord, shapes: dict[str, tuple[int, ...]], first_cap_bytes: float | None) -> list[list[str]]:
    """The buckets this record's parameters (in its recorded launch order) would form under its
    cap with the first bucket's cap set to ``first_cap_bytes`` (None: no separate first cap)."""
    order = [name for bucket in r.bucket_params or [] for name in bucket]
    params = [torch.empty(shapes[name], device="meta") for name in order]
    cap = r.bucket_cap_bytes if r.bucket_cap_bytes is not None else float("inf")
    return [[order[i] for i in bucket] for bucket in plan_buckets(params, cap, first_cap_bytes)]


def large_cap_explanation(sweep: list[StepRecord], s_bytes: float, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """Why caps that hold all ``s_bytes`` of gradients still build more than one bucket; None if none do."""
    large = [r for r in sweep if r.bucket_cap_bytes is not None and r.bucket_cap_bytes >= s_bytes
             and r.n_buckets and r.n_buckets > 1 and r.bucket_params and all(n in shapes for b in r.bucket_params for n in b)]
    if not large:
        return None
    r = large[0]
    caps = listed([f"{fmt.size_mb(x.bucket_size_mb or x.bucket_cap_bytes / MB)} MB" for x in large])  # type: ignore[operator]
    counts = sorted({x.n_buckets for x in large})
    subject = f"The caps of {caps} each hold" if len(large) > 1 else f"The cap of {caps} holds"
    built = "they built" if len(large) > 1 else "it built"
    sizes = listed([f"{fmt.mb(b)} MB" for b in r.bucket_bytes or []])
    text = [f"{subject} all s = {fmt.mb(s_bytes)} MB of gradients, yet {built} "
            f"{listed([str(c) for c in counts])} buckets ({r.variant}: {sizes}, in launch order)."]
    first, first_cap = r.bucket_params[0], r.first_bucket_cap_bytes  # type: ignore[index]
    if first_cap is not None and first_cap < (r.bucket_cap_bytes or 0):
        text.append(f"The first bucket has a cap of its own, `first_bucket_mb` = {fmt.size_mb(first_cap / MB)} MB (on by "
                    "default, as in torch's DDP), so that communication can start early in backward.")
        if len(first) == 1 and gradient_bytes(first[0], shapes) > first_cap:
            text.append(f"The first gradient in launch order, {label(first[0], shapes)}, is larger than that cap, "
                        "so it forms the first bucket alone (a parameter larger than a cap gets a bucket of its "
                        "own), and the next gradient opens a bucket under the full cap, where all the rest fit.")
        without = replan(r, shapes, None)
        text.append(f"With the lever off (`first_bucket_mb=None`), the same order and cap give {len(without)} "
                    f"bucket{'s' if len(without) != 1 else ''}. So these caps do not reduce bucketed DDP to flat "
                    f"DDP's one all-reduce after backward: the {fmt.mb(r.bucket_bytes[0])} MB first bucket is "  # type: ignore[index]
                    "reduced while backward computes the rest.")
    return " ".join(text)


def first_bucket_lever_text(default: StepRecord, no_first: StepRecord, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """What switching the first-bucket cap off changes in the plan (from both records' buckets)."""
    if not (default.bucket_params and no_first.bucket_params and default.bucket_bytes and no_first.bucket_bytes):
        return None
    on, off = default.bucket_params[0], no_first.bucket_params[0]
    cap = default.first_bucket_cap_bytes
    cap_text = f"{fmt.size_mb(cap / MB)} MB" if cap is not None else "its cap"
    text = [f"With the first-bucket lever on ({default.variant}), the first bucket is "
            f"{bucket_text(on, default.bucket_bytes[0], shapes)}; with it off ({no_first.variant}), "
            f"{bucket_text(off, no_first.bucket_bytes[0], shapes)}."]
    if cap is not None and default.bucket_bytes[0] > cap:
        text.append(f"So the lever does not make a small first bucket for this model: the first parameter alone is "
                    f"above the {cap_text} cap.")
    extra = [n for n in off if n not in on]
    if extra:
        extra_bytes = sum(gradient_bytes(n, shapes) for n in extra if n in shapes)
        later = ("the later buckets are the same" if default.bucket_params[1:] == no_first.bucket_params[1:] else
                 f"the later buckets form differently ({default.n_buckets} buckets with the lever, "
                 f"{no_first.n_buckets} without)")
        text.append(f"What it changes is that the first all-reduce starts as soon as {listed([f'`{n}`' for n in on])} "
                    f"{'is' if len(on) == 1 else 'are'} ready, instead of also waiting for the next {len(extra)} "
                    f"gradient{'s' if len(extra) != 1 else ''} ({fmt.mb(extra_bytes)} MB), and {later}. The "
                    "measured effect of switching it off measures that, not a small first bucket.")
    return " ".join(text)
