"""A step-by-step simulator of the 2026 handout's ring collectives (section 8.1), with exact times.

The handout's setting: N devices in a circle, each sending to its right neighbour at W bytes per
second of egress bandwidth, all at once, one step after another. A step takes as long as its
largest message: (bytes a device sends in that step) / W. A full tensor is S bytes, cut into N
chunks of S/N bytes.

Every device holds integers, one per chunk (a chunk's sum is the sum of its integers), so the
simulator also checks that each algorithm computes what it claims: a ring all-gather leaves every
chunk on every device, a reduce-scatter leaves device i the sum of chunk i, an all-reduce the
whole sum. Times are :class:`fractions.Fraction`, so they can equal the closed forms exactly:

* ring all-gather and ring reduce-scatter: (N − 1)/N · S/W;
* ring all-reduce (reduce-scatter, then all-gather): 2 (N − 1)/N · S/W;
* the alternate all-reduce of problem alternate_ring_all_reduce, which passes whole tensors
  x^(j) around the ring and adds each to a running sum: (N − 1) · S/W.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

Tensor = list[int]  # one integer per chunk


@dataclass
class Ring:
    """N devices in a circle; :meth:`step` sends one message from every device to its right."""

    devices: int  # N
    tensor_bytes: Fraction  # S
    bandwidth: Fraction  # W, bytes per second a device sends
    time_s: Fraction = Fraction(0)
    steps: int = 0
    sent_bytes: list[Fraction] = field(default_factory=list)  # per device, over all steps

    def __post_init__(self) -> None:
        if self.devices < 2:
            raise ValueError(f"a ring needs at least 2 devices, got {self.devices}")
        if not (self.tensor_bytes > 0 and self.bandwidth > 0):
            raise ValueError(f"S and W must be > 0, got S={self.tensor_bytes}, W={self.bandwidth}")
        self.sent_bytes = [Fraction(0)] * self.devices

    @property
    def chunk_bytes(self) -> Fraction:
        return self.tensor_bytes / self.devices

    def step(self, message: Callable[[int], tuple[list[int], Fraction]]) -> list[list[int]]:
        """Every device i sends ``message(i) = (payload, bytes)`` to (i + 1) mod N at the same time;
        returns what each device received (from (i − 1) mod N). The step lasts max(bytes) / W."""
        outgoing = [message(i) for i in range(self.devices)]
        for i, (_, size) in enumerate(outgoing):
            self.sent_bytes[i] += size
        self.time_s += max(size for _, size in outgoing) / self.bandwidth
        self.steps += 1
        return [list(outgoing[(i - 1) % self.devices][0]) for i in range(self.devices)]


def all_gather(ring: Ring, own: list[int]) -> list[Tensor]:
    """Device i starts with chunk i (``own[i]``); after N − 1 steps every device holds all N chunks.
    In step t device i passes on chunk (i − t + 1) mod N, the one it received in step t − 1."""
    n = ring.devices
    held: list[list[int | None]] = [[None] * n for _ in range(n)]
    for i in range(n):
        held[i][i] = own[i]
    for t in range(1, n):
        got = ring.step(lambda i: ([held[i][(i - t + 1) % n]], ring.chunk_bytes))
        for i in range(n):
            held[i][(i - t) % n] = got[i][0]
    missing = [(i, k) for i, row in enumerate(held) for k, chunk in enumerate(row) if chunk is None]
    if missing:
        raise AssertionError(f"all-gather on {n} devices left (device, chunk) pairs empty: {missing}")
    return [[chunk for chunk in row if chunk is not None] for row in held]


def reduce_scatter(ring: Ring, tensors: list[Tensor]) -> list[int]:
    """The handout's ring reduce-scatter: in step t device i sends its partial sum of chunk
    (i − t) mod N and adds the one it receives to chunk (i − t − 1) mod N; device i ends with the
    full sum of chunk i, which is returned for every i."""
    n = ring.devices
    y = [list(x) for x in tensors]
    for t in range(1, n):
        got = ring.step(lambda i: ([y[i][(i - t) % n]], ring.chunk_bytes))
        for i in range(n):
            y[i][(i - t - 1) % n] += got[i][0]
    return [y[i][i] for i in range(n)]


def all_reduce(ring: Ring, tensors: list[Tensor]) -> list[Tensor]:
    """Ring all-reduce: a reduce-scatter, then an all-gather of the reduced chunks."""
    return all_gather(ring, reduce_scatter(ring, tensors))


def alternate_all_reduce(ring: Ring, tensors: list[Tensor]) -> list[Tensor]:
    """Problem alternate_ring_all_reduce: in step t device i sends the whole x^((i − t + 1) mod N)
    (its own in step 1, then the one it just received) and adds x^((i − t) mod N) to its sum."""
    n = ring.devices
    y = [list(x) for x in tensors]
    passing = [list(x) for x in tensors]
    for _ in range(1, n):
        got = ring.step(lambda i: (passing[i], ring.tensor_bytes))
        for i in range(n):
            y[i] = [a + b for a, b in zip(y[i], got[i])]
        passing = got
    return y


@dataclass(frozen=True)
class Simulated:
    """One collective simulated on one ring: its time beside the handout's closed form."""

    collective: str
    devices: int
    steps: int
    time_s: Fraction
    closed_form_s: Fraction
    sent_bytes_per_device: Fraction  # every device sends the same amount in these algorithms
    correct: bool  # the simulated result equals the collective's definition


def _tensors(n: int) -> list[Tensor]:
    """Distinct integers, so that a chunk added twice or not at all changes a sum."""
    return [[(i + 1) * 10 ** 3 + (k + 1) * 7 + i * k for k in range(n)] for i in range(n)]


def simulate(collective: str, n: int, tensor_bytes: Fraction, bandwidth: Fraction) -> Simulated:
    """Run ``collective`` on a fresh ring of ``n`` devices and check its result."""
    ring = Ring(n, Fraction(tensor_bytes), Fraction(bandwidth))
    xs = _tensors(n)
    total = [sum(x[k] for x in xs) for k in range(n)]
    s_over_w = ring.tensor_bytes / ring.bandwidth
    if collective == "all-gather":
        own = [xs[i][i] for i in range(n)]
        correct = all(held == own for held in all_gather(ring, own))
        closed = Fraction(n - 1, n) * s_over_w
    elif collective == "reduce-scatter":
        correct = reduce_scatter(ring, xs) == total
        closed = Fraction(n - 1, n) * s_over_w
    elif collective == "all-reduce":
        correct = all(y == total for y in all_reduce(ring, xs))
        closed = 2 * Fraction(n - 1, n) * s_over_w
    elif collective == "alternate all-reduce":
        correct = all(y == total for y in alternate_all_reduce(ring, xs))
        closed = (n - 1) * s_over_w
    else:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    sent = set(ring.sent_bytes)
    if len(sent) != 1:
        raise AssertionError(f"{collective} on {n} devices: devices sent different amounts {sorted(sent)}")
    return Simulated(collective, n, ring.steps, ring.time_s, closed, sent.pop(), correct)


COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "alternate all-reduce")
DEVICE_COUNTS = tuple(range(2, 17))  # the N the writeup and the tests simulate


def simulate_all(tensor_bytes: Fraction = Fraction(1), bandwidth: Fraction = Fraction(1)) -> list[Simulated]:
    """Every collective on every N in :data:`DEVICE_COUNTS` (S = W = 1 unless given: times in units of S/W)."""
    return [simulate(c, n, tensor_bytes, bandwidth) for c in COLLECTIVES for n in DEVICE_COUNTS]
