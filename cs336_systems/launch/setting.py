"""The settings every multi-rank script shares: how many ranks, on which device, over which backend."""

from __future__ import annotations

from dataclasses import dataclass, field

from cs336_systems import cli
from cs336_systems.launch.context import check_devices
from cs336_systems.launch.env import launched_world_size, ranks_on_this_node


@dataclass(frozen=True)
class LaunchSetting:
    """Ranks, device and backend of a job (its ``--world-size``, ``--device``, ``--backend``)."""

    world_size: int = field(default=2, metadata=cli.count(
        "ranks to spawn on this machine (under torchrun or SLURM: the launcher's)", maximum=cli.MAX_RANKS))
    device: str = field(default="cpu", metadata=cli.choice("where each rank computes", ("cpu", "cuda")))
    backend: str | None = field(default=None, metadata=cli.choice(
        "process-group backend (default: nccl on cuda, gloo on cpu)", ("gloo", "nccl")))

    @property
    def ranks(self) -> int:
        """The world size the job will have: the launcher's, or ``world_size`` ranks spawned here."""
        return launched_world_size() or self.world_size

    @property
    def backend_name(self) -> str:
        """The backend the job will use (``backend``, or the device's default)."""
        return check_devices(self.device, self.backend, 1)[1] if self.backend is None else self.backend

    def validate(self) -> None:
        """ValueError for a value its flag's check refuses, or a device or backend that cannot serve
        these ranks (before any start). Subclasses add their own checks after this one."""
        cli.check_fields(self)
        check_devices(self.device, self.backend, ranks_on_this_node(self.ranks))
