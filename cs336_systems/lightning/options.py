"""What each of Lightning's ``DDPStrategy`` options means for our wrappers, decided before any process starts.

``lightning.pytorch.strategies.DDPStrategy`` passes its extra keyword arguments to
``torch.nn.parallel.DistributedDataParallel``. :func:`wrapper_spec` takes the same names and
either maps each to the option of ours that means the same, or refuses it with one line that
says why. The mapping:

* ``bucket_cap_mb``, ``gradient_as_bucket_view``: the bucketed variant's keywords of the same names
  (``bucket_cap_mb`` is its ``bucket_size_mb``: same meaning, same MB = 2**20 bytes). The other variants have no
  buckets: a value other than the default is refused there.
* ``broadcast_buffers``: the same in every variant (base.py broadcasts rank 0's buffers at the
  start of a synchronised forward, as torch does).
* ``find_unused_parameters``: torch needs it to tolerate parameters without a gradient; ours
  always tolerate them (their usage flags ride on the gradient all-reduce, base.py). As torch's
  DDP stops a run whose loss never reaches some trainable parameter unless it is True, so does
  the strategy (strategy.py); where every parameter is used both values train the same.
* ``static_graph``: torch uses it to learn, in the first step, which parameters get gradients
  and the order they become ready, and to skip re-deriving either later. Our overlapped
  variants learn the ready order once after the first step whatever the flag
  (``reorder_after_first_step``, overlap.py), as torch's DDP also rebuilds its buckets once
  without it, and they have no per-step traversal of the graph to skip. So ``static_graph``
  is accepted and changes nothing in ours; the claims benchmark measures it on torch's DDP.
* ``init_sync``: the wrappers' keyword of the same name (False: no broadcast of rank 0's
  parameters and buffers at construction, as torch's: every rank must build the same model).
  ``init_sync`` and ``check_reduction`` are named arguments of the strategy, as the options
  above, so that a LightningCLI YAML takes every option Python does.
* ``process_group``, ``device_ids``, ``output_device``, ``dim``, ``mixed_precision``,
  ``param_to_hook_all_reduce``, ``delay_all_reduce_named_params``, ``skip_all_reduce_unused_params``
  and the communication hooks: refused (our wrappers have no such option).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from cs336_systems.ddp import VARIANTS
from cs336_systems.ddp.auto_bucket import AUTO
from cs336_systems.ddp.base import DataParallel
from cs336_systems.ddp.bucket import bucket_cap_bytes

# The strategy's variant names (Python identifiers, as a YAML config spells them) -> the registry's.
VARIANT_NAMES = {"bucketed": "bucketed", "per_parameter": "per-parameter", "flat": "flat", "naive": "naive", "auto": "bucketed"}
DEFAULT_BUCKET_CAP_MB = 25.0  # torch's DDP default
BUCKETED = ("bucketed", "auto")

# torch DDP's keyword arguments that ours accept with the same meaning or with nothing to switch.
_ACCEPTED = {"broadcast_buffers", "find_unused_parameters", "static_graph", "init_sync", "check_reduction"}
_REFUSED = {
    "process_group": "our wrappers reduce over the default process group only",
    "device_ids": "the strategy places the model on its rank's device itself",
    "output_device": "outputs stay where the model computed them",
    "dim": "our wrappers split no batch themselves (the sampler shards it)",
    "mixed_precision": "use Trainer(precision=...) (autocast) instead",
    "param_to_hook_all_reduce": "our wrappers have no all-reduce hook on a chosen parameter",
    "delay_all_reduce_named_params": "our wrappers cannot leave chosen parameters out of overlap",
    "skip_all_reduce_unused_params": "our wrappers always reduce a gradient some rank produced",
}


@dataclass(frozen=True)
class WrapperSpec:
    """Which of our wrappers the strategy builds, and with which options."""

    variant: str  # the strategy's name for it (VARIANT_NAMES)
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of its builder

    @property
    def registry_name(self) -> str:
        return VARIANT_NAMES[self.variant]

    def wrap(self, module: nn.Module) -> DataParallel:
        return VARIANTS[self.registry_name].wrap(module, **self.options)


def wrapper_spec(
    variant: str,
    bucket_cap_mb: float | str = DEFAULT_BUCKET_CAP_MB,
    gradient_as_bucket_view: bool = True,
    ddp_kwargs: dict[str, Any] | None = None,
) -> WrapperSpec:
    """The wrapper for these options; ValueError or TypeError with one line for any it cannot honour."""
    if variant not in VARIANT_NAMES:
        raise ValueError(f"variant must be one of {', '.join(VARIANT_NAMES)}, got {variant!r}")
    if not isinstance(gradient_as_bucket_view, bool):
        raise TypeError(f"gradient_as_bucket_view must be True or False, got {gradient_as_bucket_view!r}")
    kwargs = dict(ddp_kwargs or {})
    for name in kwargs:
        if name in _REFUSED:
            raise ValueError(f"CS336DDPStrategy does not take DDP's {name}: {_REFUSED[name]}")
        if name not in _ACCEPTED:
            raise TypeError(f"CS336DDPStrategy got an unknown DDP option {name!r}")
    for name in ("broadcast_buffers", "find_unused_parameters", "static_graph", "init_sync", "check_reduction"):
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise TypeError(f"{name} must be True or False, got {kwargs[name]!r}")
    options: dict[str, Any] = {"broadcast_buffers": kwargs.get("broadcast_buffers", True)}
    if kwargs.get("init_sync", True) is False:
        options["init_sync"] = False  # the wrappers' own keyword (ddp/torch_keywords.py)
    if variant in BUCKETED:
        if variant == "auto":
            if not (bucket_cap_mb == DEFAULT_BUCKET_CAP_MB or bucket_cap_mb == AUTO):
                raise ValueError(f"variant='auto' chooses the bucket size itself; leave bucket_cap_mb at 25, got {bucket_cap_mb!r}")
            options["bucket_size_mb"] = AUTO
        else:
            if isinstance(bucket_cap_mb, str):
                raise ValueError(f"bucket_cap_mb must be a number of MB (variant='auto' chooses it), got {bucket_cap_mb!r}")
            try:
                bucket_cap_bytes(bucket_cap_mb)  # ValueError unless finite and > 0
            except (TypeError, ValueError) as e:
                raise ValueError(f"bucket_cap_mb must be a finite number of MB > 0, got {bucket_cap_mb!r}") from e
            options["bucket_cap_mb"] = float(bucket_cap_mb)
        options["gradient_as_bucket_view"] = gradient_as_bucket_view
    else:
        for name, value, default in (("bucket_cap_mb", bucket_cap_mb, DEFAULT_BUCKET_CAP_MB),
                                     ("gradient_as_bucket_view", gradient_as_bucket_view, True)):
            if value != default:
                raise ValueError(f"{name}={value!r} applies to variant='bucketed' or 'auto' only; "
                                 f"variant={variant!r} has no buckets")
    return WrapperSpec(variant, options)
