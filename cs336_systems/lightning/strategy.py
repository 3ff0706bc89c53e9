"""``CS336DDPStrategy``: Lightning's DDP strategy with one of our DDP wrappers in place of torch's.

Everything but the wrapper is Lightning's ``DDPStrategy``: the launcher, the process group, the
sampler, checkpoints, precision plugins, ``sync_batchnorm``. What differs, and why:

* ``_setup_model`` wraps the LightningModule in our variant (options.py maps DDP's options);
  with one process there is nothing to synchronise, so the module is left unwrapped.
* ``post_backward``: our wrappers, like torch's DDP, finish their reduction inside
  ``backward()`` (precision plugins unscale and clip only after the closure returns, so they
  see the averaged gradients); the wrapper's ``finish_gradient_synchronization()`` is called
  anyway and finds nothing left to do. Then, unless ``find_unused_parameters=True``, a trainable
  parameter that no rank used is refused with ``DDPStrategy``'s advice, as torch's DDP stops
  such a run (ours could train on; a parameter the loss never reaches is usually a bug). It
  reads only ``.grad is None`` after the reduction, the same on every rank, so every rank
  raises together and nothing waits for the device.
* ``block_backward_sync`` enters the wrapper's ``no_sync()``: Lightning calls it around the
  micro-batches of ``accumulate_grad_batches`` that do not step, so those communicate nothing.
* ``sync_batchnorm`` on CPU: torch's ``SyncBatchNorm`` refuses CPU tensors, so on a CPU the
  strategy converts BatchNorm layers to our CPU-capable one (sync_batchnorm.py) instead.
* ``teardown`` releases the wrapper (its hooks, buffers and in-flight work) and unwraps.

Usage, as with Lightning's own::

    trainer = Trainer(strategy=CS336DDPStrategy(variant="bucketed", bucket_cap_mb=25),
                      accelerator="cpu", devices=2)

or by name once ``cs336_systems.lightning`` is imported (``"cs336_ddp"``, and
``"cs336_ddp_find_unused_parameters_true"`` as Lightning names its own)::

    trainer = Trainer(strategy="cs336_ddp", accelerator="cpu", devices=2)

or in a LightningCLI YAML config::

    trainer:
      strategy:
        class_path: cs336_systems.lightning.CS336DDPStrategy
        init_args: {variant: bucketed, bucket_cap_mb: 25}
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Literal, Optional

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from cs336_systems.ddp.base import DataParallel
from cs336_systems.lightning.options import DEFAULT_BUCKET_CAP_MB, wrapper_spec
from cs336_systems.lightning.sync_batchnorm import CPUSyncBatchNorm

_NO_HOOKS = "our wrappers have no DDP communication hooks (torch's DDP only)"


class CS336DDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` training through ``cs336_systems.ddp``'s wrappers.

    ``variant``: bucketed, per_parameter, flat, naive or auto (bucketed with the cap chosen in
    the first steps); the other arguments are ``DDPStrategy``'s, with the same meaning, or
    refused in one line where ours have no such thing (options.py lists which). The options a
    config usually sets are named arguments, so that a LightningCLI YAML can set them.
    """

    strategy_name = "cs336_ddp"

    def __init__(
        self,
        variant: str = "bucketed",
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        init_sync: bool = True,
        check_reduction: bool = False,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        ddp_comm_state: Optional[object] = None,
        ddp_comm_hook: Optional[Callable] = None,
        ddp_comm_wrapper: Optional[Callable] = None,
        model_averaging_period: Optional[int] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        for name, value in (("ddp_comm_state", ddp_comm_state), ("ddp_comm_hook", ddp_comm_hook),
                            ("ddp_comm_wrapper", ddp_comm_wrapper)):
            if value is not None:
                raise ValueError(f"CS336DDPStrategy does not take {name}: {_NO_HOOKS}")
        if model_averaging_period is not None:
            raise ValueError("CS336DDPStrategy does not take model_averaging_period: it needs torch's "
                             "post-local-SGD communication hook")
        self._spec = wrapper_spec(variant, bucket_cap_mb, gradient_as_bucket_view,
                                  {**kwargs, "static_graph": static_graph, "broadcast_buffers": broadcast_buffers,
                                   "find_unused_parameters": find_unused_parameters, "init_sync": init_sync,
                                   "check_reduction": check_reduction})
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin, process_group_backend=process_group_backend,
            timeout=timeout, start_method=start_method,
        )
        self.variant = variant
        self.bucket_cap_mb = bucket_cap_mb
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.init_sync = init_sync
        self.check_reduction = check_reduction
        self._accumulating = False  # inside block_backward_sync: nothing reduced yet

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Lightning's registry entries, so ``Trainer(strategy="cs336_ddp")`` builds it."""
        strategy_registry.register(cls.strategy_name, cls, description="DDP through cs336_systems.ddp's wrappers",
                                   override=True)
        strategy_registry.register(f"{cls.strategy_name}_find_unused_parameters_true", cls,
                                   description="cs336_ddp with find_unused_parameters=True", override=True,
                                   find_unused_parameters=True)

    @property
    def wrapper(self) -> DataParallel | None:
        """Our wrapper while fitting on several processes; None otherwise."""
        return self.model if isinstance(self.model, DataParallel) else None

    def setup(self, trainer: Any) -> None:
        if isinstance(self._layer_sync, TorchSyncBatchNorm) and self.root_device.type == "cpu":
            self._layer_sync = CPUSyncBatchNorm()
        super().setup(trainer)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if self.world_size == 1:
            return model  # one process: nothing to synchronise, so no wrapper
        return self._spec.wrap(model)

    def _register_ddp_hooks(self) -> None:
        """Nothing to register: communication hooks are refused at construction."""

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Nothing to prepare: our hooks act on any backward of the wrapper's forward."""

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.wrapper is None:
            return
        self.wrapper.finish_gradient_synchronization()
        if not self.find_unused_parameters and not self._accumulating:
            self._refuse_unused_parameters()

    def _refuse_unused_parameters(self) -> None:
        unused = [n for n, p in self.lightning_module.named_parameters() if p.requires_grad and p.grad is None]
        if unused:
            raise RuntimeError(
                f"parameters {', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''} were not used in "
                "producing the loss returned by training_step on any rank. If this is intentional, enable the "
                "detection of unused parameters, as with DDPStrategy: strategy='cs336_ddp_find_unused_parameters_true' "
                "or CS336DDPStrategy(find_unused_parameters=True)"
            )

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        if self.wrapper is None:
            yield None
            return
        self._accumulating = True
        try:
            with self.wrapper.no_sync():
                yield None
        finally:
            self._accumulating = False

    def teardown(self) -> None:
        wrapper = self.wrapper
        if wrapper is not None:
            wrapper.release()
            self.model = self.lightning_module
        super().teardown()


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    CS336DDPStrategy.register_strategies(StrategyRegistry)


_register()
