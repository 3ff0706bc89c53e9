"""``CS336FSDPStrategy``: Lightning training through our FSDP (every parameter sharded, per unit).

What an ``FSDPStrategy`` user sets, with our FSDP's meaning:

* ``auto_wrap_policy``: the units, as module classes (``{Block}``) or a predicate on modules;
  None: each element of every ``nn.ModuleList`` (``FullyShardedDataParallel(units=...)``);
* ``compute_dtype`` / ``reduce_dtype``: ``MixedPrecisionPolicy``'s ``param_dtype`` and
  ``reduce_dtype`` (``Trainer(precision="bf16-mixed")`` autocasts as with any strategy);
* ``activation_checkpointing``: every unit under ``torch.utils.checkpoint`` (True), as
  ``activation_checkpointing_policy`` set to the unit classes;
* ``reshard_after_forward``: torch's flag (``sharding_strategy="SHARD_GRAD_OP"`` is False).

Everything else is the DDP strategy's (strategy.py): launcher, process group, sampler,
``no_sync()`` for the micro-batches of ``accumulate_grad_batches`` that do not step. The model
is wrapped before the optimizers are made, so they step the shards. Checkpoints hold whole
tensors (``state_dict_type="full"``): saving gathers every sharded parameter and every optimizer
state on all ranks and rank 0 writes them; loading cuts each rank's slice back out, so a
checkpoint loads at any world size, into this strategy or a plain model.

Every option is checked when the strategy is built, before any rank starts, with a one-line
error naming the value. From a LightningCLI YAML, ``auto_wrap_policy`` is a list of class paths
(``[torch.nn.TransformerEncoderLayer]``) and the dtypes are names (``bfloat16``): both are turned
into what they name here.

Usage::

    trainer = Trainer(strategy=CS336FSDPStrategy(auto_wrap_policy={Block}), accelerator="cpu", devices=2)
    trainer = Trainer(strategy="cs336_fsdp", accelerator="cpu", devices=2)
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any, Callable, Literal, Optional

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.tensor import DTensor

from cs336_systems.fsdp import FsdpOptions, FullyShardedDataParallel
from cs336_systems.fsdp.checkpoint import enable_optimizer_checkpoints
from cs336_systems.fsdp.composable import unit_selector
from cs336_systems.fsdp.options import COMPUTE_DTYPES
from cs336_systems.lightning.strategy import CS336DDPStrategy


def _unit_classes(policy: Any) -> Any:
    """``auto_wrap_policy`` with class paths (a YAML config's strings) imported; else as given."""
    if policy is None or callable(policy) or isinstance(policy, str) or not hasattr(policy, "__iter__"):
        return [policy] if isinstance(policy, str) else policy
    return {_import_class(c) if isinstance(c, str) else c for c in policy}


def _import_class(path: str) -> type:
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"auto_wrap_policy names {path!r}, which does not import: {e}") from e


def _dtype(name: str, value: Any) -> torch.dtype | None:
    """A dtype, or its name as a YAML config writes it (``bfloat16``, ``torch.bfloat16``)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    found = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{name} must be a torch dtype or its name (e.g. bfloat16), got {value!r}")
    return found


def _whole(value: Any) -> Any:
    """DTensors (this rank's rows) gathered whole, recursively through dicts and lists."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole(v) for v in value]
    return value


class CS336FSDPStrategy(CS336DDPStrategy):
    """Lightning's DDP strategy machinery around ``cs336_systems.fsdp``'s wrapper (``shard="all"``)."""

    strategy_name = "cs336_fsdp"

    def __init__(
        self,
        auto_wrap_policy: Optional[set | list | Callable[[nn.Module], bool]] = None,
        compute_dtype: Optional[torch.dtype | str] = None,
        reduce_dtype: Optional[torch.dtype | str] = None,
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        auto_wrap_policy = _unit_classes(auto_wrap_policy)
        unit_selector(auto_wrap_policy)  # TypeError naming the value unless classes or a predicate
        compute_dtype, reduce_dtype = _dtype("compute_dtype", compute_dtype), _dtype("reduce_dtype", reduce_dtype)
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
        FsdpOptions(reshard_after_forward=reshard_after_forward, reduce_dtype=reduce_dtype,
                    activation_checkpointing=activation_checkpointing).validate(exact_gradients=False)
        DDPStrategy.__init__(
            self, accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin, process_group_backend=process_group_backend,
            timeout=timeout, start_method=start_method,
        )
        self._fsdp_kwargs = {"units": auto_wrap_policy, "compute_dtype": compute_dtype, "reduce_dtype": reduce_dtype,
                             "activation_checkpointing": activation_checkpointing,
                             "reshard_after_forward": reshard_after_forward}
        # FSDP leaves a parameter no rank used without a gradient, as torch's FSDP does: nothing
        # to refuse (CS336DDPStrategy.post_backward).
        self.find_unused_parameters = True
        self._accumulating = False

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="FSDP through cs336_systems.fsdp",
                                   override=True)

    @property
    def wrapper(self) -> Any:
        return self.model if isinstance(self.model, FullyShardedDataParallel) else None

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if self.world_size == 1:
            return model
        kwargs = self._fsdp_kwargs
        return FullyShardedDataParallel(model, kwargs["compute_dtype"], shard="all", units=kwargs["units"],
                                        reduce_dtype=kwargs["reduce_dtype"],
                                        activation_checkpointing=kwargs["activation_checkpointing"],
                                        reshard_after_forward=kwargs["reshard_after_forward"])

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:  # loading a checkpoint comes before any step
            enable_optimizer_checkpoints(optimizer)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Whole tensors under the module's own keys (a collective: every rank saves)."""
        return _whole(dict(self.lightning_module.state_dict()))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return _whole(optimizer.state_dict())


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    CS336FSDPStrategy.register_strategies(StrategyRegistry)


_register()
