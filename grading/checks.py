"""The grader's side of a test: make the data, run the ranks, train the reference, compare.

Runs in the process that decides the grade, which never imports the submission. Every run's
data and initial weights come from ``os.urandom`` here and reach a rank only when it starts,
each rank getting its own shard of the batch. DDP ranks start from different random weights
(rank 0's are the reference's): a wrapper must broadcast them at construction, and one that
rebuilds weights from a seed fails. The reference is single-process training on the whole
batch (plain torch, no collective); every rank's parameters are compared with it after
construction and after every step, so a missing average, a missing sync or a rank left behind
fails where it happens, with the rank, step, parameter, gap and tolerance.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from grading import models, probes, training, wire

BATCH = 12  # divisible by world sizes 2 and 3
# float32: averaging shards vs one mean differs by a few ulps; a sum instead of a mean is 2x off.
RTOL, ATOL = 1e-4, 1e-6


@dataclass(frozen=True)
class DDPCase:
    get: str  # adapter that wraps the module
    after_backward: str  # adapter called after backward
    train_batch_start: str | None = None  # bucketed only
    bucket_size_mb: float | None = None  # bucketed only
    model: str = "net"  # "net", "tied", "unused" or "equal"
    optimizer: str = "sgd"  # or "adamw"
    steps: int = 3


@dataclass(frozen=True)
class ZeroCase:
    optimizer: str = "adamw"
    steps: int = 3
    layers: int = 6  # equal layers: divisible by world sizes 2 and 3


@dataclass(frozen=True)
class FSDPCase:
    optimizer: str = "sgd"
    steps: int = 3
    # Even leading dimensions, divisible by world sizes 2 and 3: the course's tests use such
    # tensors (release 26.1.4), so an FSDP that requires them is within the handout.
    shape: models.LMShape = field(default_factory=lambda: models.LMShape(vocab=36, d_model=24, d_ff=48))


def generator() -> torch.Generator:
    """A generator no submission can predict: seeded from this process's entropy, per run."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)


def random_batches(steps: int, g: torch.Generator) -> list[dict[str, torch.Tensor]]:
    return [{"x": torch.randn(BATCH, 8, generator=g), "y": torch.randn(BATCH, 4, generator=g)} for _ in range(steps)]


def shard(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    return {k: v[rows].clone() for k, v in batch.items()}


def random_state(model: str, g: torch.Generator, layers: int = 8) -> dict[str, torch.Tensor]:
    """A fresh model's weights, drawn from ``g``: every rank gets different ones."""
    state = models.build(model, layers).state_dict()
    return {k: torch.randn(v.shape, generator=g) * 0.3 if v.is_floating_point() else v for k, v in state.items()}


def compare(reports: list[dict], expected: list[dict[str, torch.Tensor]], what: list[str]) -> None:
    """Each rank's parameters at each checkpoint against the reference's; the first gap, by step."""
    for step, reference in enumerate(expected):
        for rank, report in enumerate(reports):
            got_all = report["params"][step] if step < len(report["params"]) else {}
            for name, want in reference.items():
                got = got_all.get(name)
                if got is None:
                    raise AssertionError(f"rank {rank}: no parameter named {name} {what[step]} "
                                         f"(it reported: {', '.join(got_all) or 'none'})")
                if got.numel() == want.numel() and got.shape != want.shape:
                    got = got.reshape(want.shape)
                if got.shape != want.shape:
                    raise AssertionError(f"rank {rank}: parameter {name} has shape {tuple(got.shape)} {what[step]}, "
                                         f"expected {tuple(want.shape)}")
                got = got.to(want.dtype)
                if not torch.allclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=False):
                    gap = (got - want).abs()
                    worst = int(torch.nan_to_num(gap, nan=float("inf")).argmax())
                    allowed = ATOL + RTOL * want.flatten()[worst].abs().item()
                    raise AssertionError(
                        f"rank {rank}, step {step}: parameter {name} differs from single-process training "
                        f"by {gap.flatten()[worst].item():.3g} at element {worst} {what[step]} "
                        f"(tolerance {ATOL:g} + {RTOL:g}·|expected| = {allowed:.3g} there)")


def _labels(steps: int, start: str) -> list[str]:
    return [start] + [f"after optimizer step {s} of {steps}" for s in range(1, steps + 1)]


def _train(reference: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[dict], loss) -> list[dict]:
    snapshots = [training.snapshot(dict(reference.named_parameters()))]
    for batch in batches:
        optimizer.zero_grad()
        loss(reference, batch).backward()
        optimizer.step()
        snapshots.append(training.snapshot(dict(reference.named_parameters())))
    return snapshots


def _mse(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"])


def run_ddp(ranks, world_size: int, case: DDPCase) -> list[dict]:
    """Train ``case`` through the DDP adapters on ``world_size`` ranks; each rank's report."""
    g = generator()
    inits = [random_state(case.model, g) for _ in range(world_size)]
    batches = random_batches(case.steps, g)
    payloads = [wire.encode({"case": asdict(case), "init": inits[r],
                             "batches": [shard(b, r, world_size) for b in batches]}) for r in range(world_size)]
    reports = ranks(training.train_ddp, world_size, payloads)
    reference = models.build(case.model)
    reference.load_state_dict(inits[0])
    expected = _train(reference, models.make_optimizer(case.optimizer, reference.parameters()), batches, _mse)
    compare(reports, expected, _labels(case.steps, "after construction (every rank must start from rank 0's weights)"))
    return reports


def run_sharded_optimizer(ranks, world_size: int, case: ZeroCase) -> tuple[list[dict], int]:
    """Train with the sharded optimizer (every rank on the whole batch); the reports, and the
    bytes of state an unsharded optimizer of the same class holds after the same steps."""
    g = generator()
    init = random_state("equal", g, case.layers)
    batches = random_batches(case.steps, g)
    payload = wire.encode({"case": asdict(case), "init": init, "batches": batches})
    reports = ranks(training.train_sharded_optimizer, world_size, [payload] * world_size)
    reference = models.build("equal", case.layers)
    reference.load_state_dict(init)
    cls, kwargs = models.optimizer_class(case.optimizer)
    optimizer = cls(reference.parameters(), **kwargs)
    compare(reports, _train(reference, optimizer, batches, _mse), _labels(case.steps, "after construction"))
    exclude = {p.untyped_storage().data_ptr() for p in reference.parameters()}
    exclude |= {p.grad.untyped_storage().data_ptr() for p in reference.parameters() if p.grad is not None}
    return reports, sum(h.nbytes for h in probes.held_tensors(optimizer, "optimizer", exclude))


def run_fsdp(ranks, world_size: int, case: FSDPCase) -> tuple[list[dict], int]:
    """Train through the FSDP adapters; the reports, and the bytes of the full parameters."""
    g = generator()
    vocab = case.shape.vocab
    batches = [{"ids": torch.randint(0, vocab, (BATCH, 6), generator=g),
                "labels": torch.randint(0, vocab, (BATCH, 6), generator=g)} for _ in range(case.steps)]
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
    job = {"case": {"optimizer": case.optimizer, "shape": asdict(case.shape)}, "seed": seed}
    payloads = [wire.encode({**job, "batches": [shard(b, r, world_size) for b in batches]}) for r in range(world_size)]
    reports = ranks(training.train_fsdp, world_size, payloads)
    try:
        reference = models.ReferenceLM(case.shape, reports[0]["init"])
    except (ValueError, KeyError) as e:
        raise AssertionError(f"rank 0: the model built from cs336_basics' Linear and Embedding: {e}") from e
    optimizer = models.make_optimizer(case.optimizer, reference.parameters())

    def cross_entropy(model, batch):
        return F.cross_entropy(model(batch["ids"]).flatten(0, 1), batch["labels"].flatten())

    expected = _train(reference, optimizer, batches, cross_entropy)[1:]
    gathered = [{"params": [training.by_model_names(p, expected[0]) for p in r["params"]]} for r in reports]
    compare(gathered, expected, _labels(case.steps, "")[1:])
    return reports, sum(p.numel() * p.element_size() for p in reference.parameters())


def assert_sharded(reports: list[dict], key: str, full_bytes: int, what: str) -> None:
    """Every rank holds at most 1/world size of ``full_bytes``, plus a quarter of the whole for
    a split by whole tensors (the suite's models split evenly by layers at world sizes 2 and 3)."""
    world_size = len(reports)
    for rank, report in enumerate(reports):
        held = report[key]
        share = held["bytes"] / full_bytes
        if share > 1 / world_size + 0.25:
            largest = "; ".join(held["largest"]) or "nothing"
            raise AssertionError(
                f"rank {rank} holds {held['bytes']} bytes of {what}, {share:.0%} of the unsharded {full_bytes} "
                f"(sharded: at most 1/{world_size} + 25%); largest: {largest}")
