"""The bytes each rank sends in section 8's FFN under DP, FSDP and TP, measured on gloo ranks.

:func:`measure_ffn_bytes` spawns ``world_size`` gloo ranks on this machine; each runs every
strategy of :mod:`.ffn_check` (one forward and one backward through real collectives) and returns
the bytes it wrote in each pass and how far its gradients are from single-process autograd. One
:class:`FfnBytesRecord` per (strategy, world size) holds every rank's bytes beside the handout's
term; ``scripts/measure_ffn_bytes.py`` writes them to ``writeup/results/<tag>/ffn_bytes.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from cs336_systems import cli
from cs336_systems.capacity import ffn_check as fc
from cs336_systems.capacity.strategies import Ffn
from cs336_systems.launch import launch
from cs336_systems.results.schema import Record

# Gloo adds a small header to every message; a rank's bytes may exceed the handout's term by this
# fraction (measured: under 0.5% at the default shape) but never fall short of it.
HEADER_ALLOWANCE = 0.01
# Gradients travel in FP16 (relative rounding 2^-11) and are of order 1 at the default shape.
GRADIENT_TOLERANCE = 1e-2


@dataclass(frozen=True)
class FfnBytesSetting:
    """The FFN and the groups it runs on (the script's flags)."""

    world_sizes: tuple[int, ...] = field(default=(2, 4), metadata=cli.count(
        "gloo ranks of each group, one group per value", minimum=2, maximum=8, many=True))
    batch: int = field(default=512, metadata=cli.count("B: rows of x, split over DP and FSDP ranks", maximum=4096))
    d_model: int = field(default=256, metadata=cli.count("D", maximum=4096))
    d_ff: int = field(default=512, metadata=cli.count("D_FF, split over TP ranks", maximum=16384))

    @property
    def ffn(self) -> Ffn:
        return Ffn(self.batch, self.d_model, self.d_ff)

    def validate(self) -> None:
        cli.check_fields(self)
        for n in self.world_sizes:
            if self.batch % n or self.d_ff % n or self.d_model % n:
                raise ValueError(f"B = {self.batch}, D = {self.d_model} and D_FF = {self.d_ff} must each "
                                 f"split evenly over world size {n}")


@dataclass(frozen=True)
class FfnBytesRecord(Record):
    """One strategy on one group: bytes every rank sent, beside the handout's communication term."""

    KIND: ClassVar[str] = "ffn_bytes"
    VERSION: ClassVar[int] = 1

    strategy: str  # DP, FSDP, TP, or gloo's own reduce_scatter_tensor of one [D, D_FF] weight
    world_size: int
    forward_bytes: list[int]  # per rank, written to sockets during the forward pass
    backward_bytes: list[int]  # per rank, during the backward pass
    expected_forward_bytes: float  # the handout's term at W = 1 byte/s
    expected_backward_bytes: float
    max_gradient_error: float  # over ranks: |ours − single-process autograd|, weights' gradients and TP's dx

    def _sent_and_term(self) -> list[tuple[int, float]]:
        """(bytes a rank sent, the term) for every rank and pass."""
        return ([(b, self.expected_forward_bytes) for b in self.forward_bytes]
                + [(b, self.expected_backward_bytes) for b in self.backward_bytes])

    def excess(self) -> float:
        """The largest relative excess of a rank's bytes over the term (a pass with no term counts its bytes)."""
        return max((b - e) / e if e else float(b) for b, e in self._sent_and_term())

    def matches(self) -> bool:
        """Every rank sent at least the term and at most :data:`HEADER_ALLOWANCE` more."""
        return all(e <= b <= e * (1 + HEADER_ALLOWANCE) for b, e in self._sent_and_term())


def _rank(ctx, strategies: tuple[str, ...], ffn: Ffn) -> dict[str, fc.RankBytes]:
    return {s: fc.measure_rank(ctx.rank, ctx.world_size, s, ffn) for s in strategies}


def measure_ffn_bytes(setting: FfnBytesSetting,
                      strategies: tuple[str, ...] = (*fc.MEASURED, fc.GLOO_REDUCE_SCATTER)) -> list[FfnBytesRecord]:
    """Every strategy on a gloo group of each world size: one record per (strategy, world size)."""
    setting.validate()
    records = []
    for n in setting.world_sizes:
        ranks = launch(_rank, n, (strategies, setting.ffn), backend="gloo", device_type="cpu")
        for s in strategies:
            mine = [r[s] for r in ranks]
            forward, backward = fc.expected_bytes(s, setting.ffn, n)
            records.append(FfnBytesRecord(s, n, [m.forward_bytes for m in mine], [m.backward_bytes for m in mine],
                                          forward, backward, max(m.max_error for m in mine)))
    return records
