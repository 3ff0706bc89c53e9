"""Our DDP wrappers inside PyTorch Lightning: a strategy for ``Trainer(strategy=...)``.

* options.py         what each of ``DDPStrategy``'s options means for our wrappers (or why it is refused)
* strategy.py        ``CS336DDPStrategy``: Lightning's DDP strategy with our wrapper in place of torch's
* fsdp_strategy.py   ``CS336FSDPStrategy``: the same machinery around our FSDP (every parameter sharded)
* sync_batchnorm.py  BatchNorm over the global batch on CPUs too (``sync_batchnorm=True`` with gloo)

The claims benchmark that runs it beside Lightning's own ``DDPStrategy`` is in
``cs336_systems/bench/claims/``.
"""

from cs336_systems.lightning.options import VARIANT_NAMES, WrapperSpec, wrapper_spec
from cs336_systems.lightning.strategy import CS336DDPStrategy
from cs336_systems.lightning.fsdp_strategy import CS336FSDPStrategy
from cs336_systems.lightning.sync_batchnorm import CPUSyncBatchNorm, GlobalBatchNorm, convert_batchnorm
