"""Re-export of the top-level adapters, where the public CS336 test files import them from."""

from adapters import (  # noqa: F401
    ddp_bucketed_on_after_backward,
    ddp_bucketed_on_train_batch_start,
    ddp_individual_parameters_on_after_backward,
    ddp_on_after_backward,
    fsdp_gather_full_params,
    fsdp_on_after_backward,
    get_ddp,
    get_ddp_bucketed,
    get_ddp_individual_parameters,
    get_fsdp,
    get_sharded_optimizer,
)
