"""What the all-reduce benchmark is asked to run: the grid's settings (its CLI) and one point of it.

:class:`AllReduceSetting` is the run as a whole (backends x world sizes x payloads, iteration
counts, time budget, memory share); its fields carry their command-line flags, so the script's
flags cannot drift from it, and :meth:`AllReduceSetting.validate` holds every check that spans
several flags, run before any process starts. :class:`GridPoint` is one (backend, world size,
payload) of the grid, as a group of ranks runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cs336_systems import cli
from cs336_systems.launch import backend_for_device, check_devices, launched_world_size, ranks_on_this_node
from cs336_systems.units import MB

FLOAT32_BYTES = 4
BACKENDS = ("gloo", "nccl")
DEFAULT_WARMUP_ITERS = 5  # nccl-tests' defaults: -w 5 warm-up iterations ...
DEFAULT_TIMED_ITERS = 20  # ... and -n 20 timed ones
MIN_TIMED_ITERS = 3  # fewest timed iterations worth a median; below this a payload is skipped
# Share of free RAM (MemAvailable, read when a group starts; or of a GPU's memory) that all ranks'
# buffers may take. The other 15% is the margin for the ranks' own processes (a gloo rank with torch
# loaded peaks at about 0.57 GiB RSS, most of it shared libraries mapped once) and the rest of the
# machine: on 22 GiB free, 6 ranks' 3 buffers of 1000 MB (17.6 GiB) fit under 18.7 GiB, where a
# guard of 50% skipped them and the 4-rank ones (11.7 GiB) though they fit.
DEFAULT_MEMORY_FRACTION = 0.85
MAX_BUDGET_S = 7 * 24 * 3600.0  # a week: far beyond any run, low enough to catch a typo


def payload_bytes(size_mb: float) -> int:
    """A payload given in MB (2**20 bytes) in bytes, rounded down to whole float32 elements."""
    return int(size_mb * MB) // FLOAT32_BYTES * FLOAT32_BYTES


@dataclass(frozen=True)
class AllReduceSetting:
    """One run of the benchmark: which groups to start, which payloads each reduces, how long."""

    backend: str | None = field(default=None, metadata=cli.choice(
        "process-group backend; 'both' runs gloo then nccl (default: nccl on cuda, gloo on cpu)",
        ("gloo", "nccl", "both")))
    device: str = field(default="cpu", metadata=cli.choice("where each rank's payload lives", ("cpu", "cuda")))
    world_sizes: tuple[int, ...] = field(default=(2, 4, 6), metadata=cli.count(
        "ranks of each group, one group per value (under torchrun or SLURM: the launcher's)",
        minimum=2, maximum=cli.MAX_RANKS, many=True))
    sizes_mb: tuple[float, ...] = field(default=(1, 10, 100, 1000), metadata=cli.positive(
        "payloads per rank, MB = 2**20 bytes of float32", high=cli.MAX_MB, many=True))
    warmup: int = field(default=DEFAULT_WARMUP_ITERS, metadata=cli.count(
        "untimed all-reduces before each payload's timed ones", minimum=0))
    iters: int = field(default=DEFAULT_TIMED_ITERS, metadata=cli.count(
        "timed all-reduces per payload (fewer when the budget is short)"))
    budget_s: float = field(default=300.0, metadata=cli.positive(
        "wall-clock budget for the whole grid, seconds", high=MAX_BUDGET_S))
    memory_fraction: float | None = field(default=DEFAULT_MEMORY_FRACTION, metadata=cli.fraction(
        "share of free RAM (cpu) or of a GPU's memory that all ranks' buffers may take"))
    min_timed_iters: int = MIN_TIMED_ITERS  # fewest timed iterations worth running (no flag)

    @property
    def backends(self) -> list[str]:
        """The backends to run, in order ('both' is gloo then nccl; None is the device's default)."""
        if self.backend == "both":
            return list(BACKENDS)
        return [self.backend or backend_for_device(self.device)]

    @property
    def group_world_sizes(self) -> list[int]:
        """World sizes of the groups: the launcher's one under torchrun/SLURM, else ``world_sizes``."""
        launched = launched_world_size()
        return [launched] if launched is not None else list(dict.fromkeys(self.world_sizes))

    @property
    def payloads(self) -> list[int]:
        """Payload sizes in bytes, smallest first, without repeats."""
        return sorted({payload_bytes(mb) for mb in self.sizes_mb})

    def validate(self) -> None:
        """ValueError naming the flag for anything that cannot run, before any process starts."""
        if not self.world_sizes or any(ws < 2 for ws in self.world_sizes):
            raise ValueError(f"--world-sizes must all be >= 2 (one rank reduces nothing), got {list(self.world_sizes)}")
        if not self.sizes_mb:
            raise ValueError("--sizes-mb needs at least one payload size")
        for size_mb in self.sizes_mb:
            if not size_mb > 0 or payload_bytes(size_mb) < FLOAT32_BYTES:
                raise ValueError(f"--sizes-mb {size_mb:g} holds no float32 element (4 bytes = {4 / MB:.3g} MB)")
        if self.warmup < 0 or self.iters < 1 or self.min_timed_iters < 1:
            raise ValueError(f"need --warmup >= 0 and --iters >= 1, got {self.warmup} and {self.iters}")
        if not 0 < self.budget_s <= MAX_BUDGET_S:
            raise ValueError(f"--budget-s must be > 0 and <= {MAX_BUDGET_S:g}, got {self.budget_s}")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"--memory-fraction must be in (0, 1], got {self.memory_fraction}")
        if self.backend not in (None, "both", *BACKENDS):
            raise ValueError(f"--backend must be one of gloo, nccl, both, got {self.backend!r}")
        if launched_world_size() is not None and len(self.backends) > 1:
            raise ValueError(
                "--backend both needs one group per backend: under torchrun or SLURM run one backend per job")
        for backend in self.backends:
            for world_size in self.group_world_sizes:
                try:
                    check_devices(self.device, backend, ranks_on_this_node(world_size))
                except ValueError as e:
                    chosen = f"--backend {backend}" if self.backend else f"the default backend {backend}"
                    raise ValueError(f"--device {self.device} with {chosen}, world size {world_size}: {e}") from e

    def grid(self, backend: str, world_size: int) -> list[GridPoint]:
        """The points one group runs: every payload, smallest first."""
        return [GridPoint(backend, self.device, world_size, p, self.warmup, self.iters) for p in self.payloads]


@dataclass(frozen=True)
class GridPoint:
    """One point of the grid: a payload reduced by one group."""

    backend: str  # "gloo" or "nccl"
    device_type: str  # where the payload lives: "cpu" or "cuda"
    world_size: int  # ranks taking part in the all-reduce
    payload_bytes: int  # size of each rank's tensor (float32, so a multiple of 4)
    warmup_iters: int  # untimed all-reduces asked for before timing starts
    timed_iters: int  # timed all-reduces asked for (the budget may lower it)

    @property
    def label(self) -> str:
        return f"{self.backend} x{self.world_size} {self.payload_bytes / MB:g} MB"
