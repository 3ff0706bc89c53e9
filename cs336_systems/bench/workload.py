"""The workload every DDP benchmark trains: the Transformer LM on a fixed random batch.

One definition for the step benchmark, the profiler, the sharded-optimizer accounting and the
FSDP benchmark: the same seed gives the same weights on every rank (before any broadcast) and
the same global batch, of which each rank takes its contiguous shard of rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from cs336_basics.model import MODEL_SIZES, TransformerConfig, TransformerLM, model_config
from cs336_systems import cli
from cs336_systems.launch.context import RankContext
from cs336_systems.launch.setting import LaunchSetting

MAX_CONTEXT = 1 << 16


def shard_rows(batch_size: int, rank: int, world_size: int) -> slice:
    """Rows of a global batch that ``rank`` trains on; the batch must split evenly."""
    if batch_size % world_size != 0:
        raise ValueError(
            f"batch of {batch_size} examples cannot be split evenly over world size {world_size}"
        )
    shard = batch_size // world_size
    return slice(rank * shard, (rank + 1) * shard)


@dataclass(frozen=True)
class WorkloadSetting(LaunchSetting):
    """A job (ranks, device, backend) training the LM of ``model_size`` on ``global_batch`` sequences."""

    model_size: str = field(default="cpu-small", metadata=cli.choice("model (cs336_basics.model.MODEL_SIZES)", MODEL_SIZES))
    context_length: int = field(default=128, metadata=cli.count("tokens per sequence", maximum=MAX_CONTEXT))
    global_batch: int = field(default=4, metadata=cli.count("sequences per step over all ranks"))
    seed: int = field(default=0, metadata=cli.count("seed of the weights and the data", minimum=0))

    @property
    def model_config(self) -> TransformerConfig:
        return model_config(self.model_size, self.context_length)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.context_length

    def validate(self) -> None:
        super().validate()
        self.model_config  # ValueError for a context the model cannot take
        shard_rows(self.global_batch, 0, self.ranks)


@dataclass
class Workload:
    """What one rank trains: the model on its device and its shard of the batch."""

    config: TransformerConfig | None  # None: a model that is not the LM (bench/family's)
    module: nn.Module
    tokens: torch.Tensor  # [rows of this rank, context_length]
    targets: torch.Tensor  # the next token of each position


def build_workload(ctx: RankContext, setting: WorkloadSetting, init_on_device: bool = False) -> Workload:
    """The seeded model on ``ctx.device`` and this rank's rows of the seeded batch; also gives
    the rank its share of CPU threads. ``init_on_device``: draw the initial weights on the device
    itself (the same on every rank, other values than a CPU's draw), for runs that build a
    billion-parameter model once per process, where the CPU's draw takes tens of seconds."""
    ctx.share_cpu_threads()
    config = setting.model_config
    torch.manual_seed(setting.seed)
    if init_on_device:
        with torch.device(ctx.device):
            module = TransformerLM(config)
    else:
        module = TransformerLM(config).to(ctx.device)
    g = torch.Generator().manual_seed(setting.seed)
    data = torch.randint(0, config.vocab_size, (setting.global_batch, config.context_length + 1), generator=g)
    rows = shard_rows(setting.global_batch, ctx.rank, ctx.world_size)
    return Workload(config, module, data[rows, :-1].to(ctx.device), data[rows, 1:].to(ctx.device))
