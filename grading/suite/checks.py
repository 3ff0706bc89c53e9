"""The grader's side of a test: make the data, run the ranks, train the reference, compare.

Runs in the process that decides the grade, which never imports the submission. Every run's
data and initial weights come from ``os.urandom`` here and reach a rank only when it starts,
each rank getting its own shard of the batch. DDP ranks start from different random weights
(rank 0's are the reference's): a wrapper must broadcast them at construction, and one that
rebuilds weights from a seed fails. The reference is single-process training on the whole
batch (plain torch, no collective); every rank's parameters are compared with it after
construction and after every step ("after construction", "after step 1 of 3": one numbering
everywhere), so a missing average, a missing sync or a rank left behind fails where it happens:
first whether the ranks agree with each other ("rank 0 and rank 1 hold different weights after
step 1 of 3: gradients are not averaged over ranks"), then the rank, parameter, gap and
tolerance against the reference. The reference must move, or the test could not tell.

A run returns its finding instead of raising it (``Run``): a test of what a problem is named for
(sharding, overlap) reports its own finding first and the training's after it (``findings``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F

from grading.readings import carried, memory, probes, review
from grading.suite import models, training
from grading.isolation import wire
from grading.problems import named_for

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
    traffic: dict | None = None  # the loopback's bytes read at holds (carried.py): the calibration's expectations


@dataclass(frozen=True)
class ZeroCase:
    optimizer: str = "adamw"
    steps: int = 3
    layers: int = 6  # equal layers: divisible by world sizes 2 and 3
    groups: bool = False  # two parameter groups with their own lr and weight_decay (models.zero_groups)
    unfreeze: bool = False  # two layers frozen, then added as a group after step 1 (models.added_group)
    measure_state: bool = False  # the ranks' memory read from outside (grading/readings/memory.py), a model that shows it
    width: int = 32  # the equal layers' width (MEASURED_WIDTH when measure_state)


# Equal layers of this width make AdamW's state 12 MiB (two float32 copies of 6 layers of
# 512×512): a third of it is 4 MiB, forty times the spread of a correct rank's memory (0.1 MiB).
MEASURED_WIDTH = 512
SAMPLED = 256  # values per large tensor compared with the reference when the model is measured


@dataclass(frozen=True)
class FSDPCase:
    optimizer: str = "sgd"
    steps: int = 3
    # Even leading dimensions, divisible by world sizes 2 and 3: the course's tests use such
    # tensors (release 26.1.4), so an FSDP that requires them is within the handout.
    shape: models.LMShape = field(default_factory=lambda: models.LMShape(vocab=36, d_model=24, d_ff=48))
    compute_dtype: str | None = None  # "float16" or "bfloat16"
    measure: bool = False  # the ranks' memory read from outside (grading/readings/memory.py), on models.MEASURED_LM
    traffic: bool = False  # the loopback's bytes read at holds (grading/readings/traffic.py), on models.TRAFFIC_LM


@dataclass
class Run:
    """A test's ranks' reports, what the check found about training, and what sizes it needs."""

    reports: list[dict]
    mismatch: str = ""  # the first difference from single-process training, "" if none
    full_bytes: int = 0  # what an unsharded rank holds (optimizer state; FSDP's full parameters)
    model_bytes: int = 0  # the parameters every rank holds in full (the sharded optimizer's model)
    weights: dict[str, int] = field(default_factory=dict)  # FSDP: each Linear and Embedding weight's bytes
    replicated: int = 0  # FSDP: the bytes of the parameters no rank shards (norm, biases)
    activations: int = 0  # FSDP: what one rank's forward saves for backward, logits included
    calibration: list[dict] = field(default_factory=list)  # a measured run's: the grader's own ranks' reports

    def assert_matches(self) -> None:
        if self.mismatch:
            raise AssertionError(self.mismatch)


def findings(*found: str) -> None:
    """Fail with every finding, each check's own first: one does not hide another. A hold for
    review (review.py) is the failure only when nothing else failed: wrong training is wrong
    whatever the witnesses say."""
    real = [f for f in found if f and not review.is_held(f)]
    if real:
        raise AssertionError("; also: ".join(real))
    held = [f for f in found if f]
    if held:
        raise AssertionError(held[0])


def generator() -> torch.Generator:
    """A generator no submission can predict: seeded from this process's entropy, per run."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)


def random_batches(steps: int, g: torch.Generator) -> list[dict[str, torch.Tensor]]:
    return [{"x": torch.randn(BATCH, 8, generator=g), "y": torch.randn(BATCH, 4, generator=g)} for _ in range(steps)]


def shard(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    return {k: v[rows].clone() for k, v in batch.items()}


def random_state(model: str, g: torch.Generator, layers: int = 8, width: int = 32) -> dict[str, torch.Tensor]:
    """A fresh model's weights, drawn from ``g``: every rank gets different ones. A wider model's
    weights are smaller in proportion (as 1/sqrt(fan-in)): its tanh layers must not saturate, or
    AdamW would turn the rounding of tiny gradients into differences beyond tolerance."""
    state = models.build(model, layers, width).state_dict()
    scale = 0.3 * min(1.0, (32 / width) ** 0.5)
    return {k: torch.randn(v.shape, generator=g) * scale if v.is_floating_point() else v for k, v in state.items()}


def labels(steps: int, construction: bool = True) -> list[str]:
    """Checkpoints, numbered one way everywhere: "after construction", "after step 1 of 3", ..."""
    return ["after construction"] * construction + [f"after step {s} of {steps}" for s in range(1, steps + 1)]


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> tuple[bool, float, int, float]:
    """Whether ``got`` is within tolerance of ``want``; the largest gap, where, and what was allowed there."""
    got = got.to(want.dtype)
    if torch.allclose(got, want, rtol=rtol, atol=atol, equal_nan=False):
        return True, 0.0, 0, 0.0
    gap = (got - want).abs()
    worst = int(torch.nan_to_num(gap, nan=float("inf")).argmax())
    return False, gap.flatten()[worst].item(), worst, atol + rtol * want.flatten()[worst].abs().item()


def _as_reference(got: torch.Tensor | None, want: torch.Tensor) -> torch.Tensor | None:
    if got is not None and got.numel() == want.numel() and got.shape != want.shape:
        return got.reshape(want.shape)
    return got


def compare(reports: list[dict], expected: list[dict[str, torch.Tensor]], what: list[str],
            disagree: tuple[str, str], tolerance: tuple[float, float] = (RTOL, ATOL)) -> str:
    """Each rank's parameters at each checkpoint, in order: first whether the ranks agree with each
    other (``disagree``: what it means at construction, and after a step), then each against the
    reference. The first finding, or ""."""
    rtol, atol = tolerance
    for step, reference in enumerate(expected):
        held = [r["params"][step] if step < len(r["params"]) else {} for r in reports]
        for rank in range(1, len(reports)):
            for name, want in reference.items():
                mine, theirs = _as_reference(held[0].get(name), want), _as_reference(held[rank].get(name), want)
                if mine is None or theirs is None or mine.shape != theirs.shape:
                    continue
                ok, gap, worst, _ = _close(theirs, mine.to(want.dtype), rtol, atol)
                if not ok:
                    meaning = disagree[0] if what[step] == "after construction" else disagree[1]
                    return (f"rank 0 and rank {rank} hold different weights {what[step]}: {meaning} "
                            f"({name} differs by {gap:.3g} at element {worst})")
        for rank, got_all in enumerate(held):
            for name, want in reference.items():
                got = _as_reference(got_all.get(name), want)
                if got is None:
                    return (f"rank {rank}: no parameter named {name} {what[step]} "
                            f"(it reported: {', '.join(got_all) or 'none'})")
                if got.shape != want.shape:
                    return f"rank {rank}: parameter {name} has shape {tuple(got.shape)} {what[step]}, expected {tuple(want.shape)}"
                ok, gap, worst, allowed = _close(got, want, rtol, atol)
                if not ok:
                    return (f"rank {rank}: parameter {name} {what[step]} differs from single-process training "
                            f"by {gap:.3g} at element {worst} (tolerance {atol:g} + {rtol:g}·|expected| = {allowed:.3g} there)"
                            + (_factor(got, want, expected[step - 1][name]) if step else ""))
    return ""


def _factor(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor) -> str:
    """When a step moved a parameter by the reference's step times one factor, the same on every
    element (within 1%), what that factor suggests: a gradient scaled by a wrong count (summed
    over 2 ranks: 2; divided by 3 after averaging: 0.333), or that the step never moved it. "" otherwise,
    or for a factor near 1."""
    moved, wanted = got.to(want.dtype).flatten() - before.flatten(), want.flatten() - before.flatten()
    norm = float(wanted @ wanted)
    if norm == 0.0 or not torch.isfinite(moved).all():
        return ""
    if float(moved.norm()) == 0.0:  # a factor of 0 is no wrong count: the step left it where it was
        return "; the step did not move it at all (a parameter the optimizer never stepped?)"
    factor = float(moved @ wanted) / norm
    if abs(factor - 1) < 0.05 or float((moved - factor * wanted).norm()) > 0.01 * norm ** 0.5 * abs(factor):
        return ""
    return (f"; the step moved it {factor:.3g} times as far as single-process training, the same factor on every "
            "element: gradients scaled by a wrong count (the average's divisor?)")


def _train(reference: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[dict], loss,
           after_step=None, keep=training.snapshot) -> list[dict]:
    """Single-process training, a snapshot after construction and after every step. It must move
    every parameter that gets a gradient: a test whose reference stands still could not tell a wrong
    submission (one that never communicates, say) from a right one. One thread, as a rank
    computes: a gradient whose terms nearly cancel keeps the rounding of its summation order,
    and AdamW turns that into the weight. ``keep`` makes each snapshot (a sample of a large model)."""
    first = keep(dict(reference.named_parameters()))
    snapshots = [first]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step, batch in enumerate(batches, 1):
            optimizer.zero_grad()
            loss(reference, batch).backward()
            optimizer.step()
            snapshots.append(keep(dict(reference.named_parameters())))
            if after_step is not None and (group := after_step(step)) is not None:
                optimizer.add_param_group(group)
    finally:
        torch.set_num_threads(threads)
    still = [n for n, p in reference.named_parameters()
             if p.grad is not None and torch.equal(keep({n: p})[n], first[n])]
    if still:
        raise RuntimeError(f"grader error: the reference did not move {', '.join(still)}; this test cannot tell")
    return snapshots


def _mse(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"])


DDP_DISAGREE = ("rank 0's weights were not broadcast at construction", "gradients are not averaged over ranks")


def run_ddp(ranks, world_size: int, case: DDPCase) -> Run:
    """Train ``case`` through the DDP adapters on ``world_size`` ranks; reports and finding."""
    g = generator()
    inits = [random_state(case.model, g, width=models.WIDE["width"] if case.model == "wide" else 32)
             for _ in range(world_size)]
    batches = random_batches(case.steps, g)
    sent, releases = carried.batches_at_holds(batches, world_size, shard) if case.traffic else (batches, None)
    payloads = [wire.encode({"case": asdict(case), "init": inits[r],
                             "batches": [shard(b, r, world_size) for b in sent]}) for r in range(world_size)]
    reports = ranks(training.train_ddp, world_size, payloads, releases)
    reference = models.build(case.model)
    reference.load_state_dict(inits[0])
    expected = _train(reference, models.make_optimizer(case.optimizer, reference.parameters()), batches, _mse)
    what = labels(case.steps)
    what[0] += " (every rank must start from rank 0's weights)"
    return Run(reports, compare(reports, expected, what, DDP_DISAGREE))


def overlap_finding(reports: list[dict], model: str, problem: str) -> str:
    """Whether the gradients overlapped backward: per rank and step, the all-reduces issued before
    the probe's backward (the layers below it still computing) must carry at least half the bytes
    of the gradients ready by then, asynchronously (``async_op=True``, waited on only once the
    layers below the probe have had their turn: after backward, or at its very end, as torch's DDP
    waits in its final callback). "" when they did; else what was seen, ending with
    ``named_for(problem)``."""
    missed = f"; gradients do not overlap backward {named_for(problem)}"
    ready = models.above_probe_bytes(models.build(model))
    for rank, report in enumerate(reports):
        for step, calls in enumerate(report["reductions"], 1):
            during = [c for c in calls if c[1]]
            carried = sum(c[0] for c in during)
            left_running = sum(c[0] for c in during if c[2])
            where = f"rank {rank}, step {step}"
            if not during:
                return (f"{where}: no all-reduce was issued while backward ran ({len(calls)} after it): gradients "
                        f"must be communicated as they become ready, not after backward{missed}")
            if carried < ready / 2:
                return (f"{where}: the {len(during)} all-reduces issued while backward ran carried {carried} bytes, "
                        f"under half of the {ready} bytes of gradients ready by then: they do not carry the gradients{missed}")
            if left_running < ready / 2:
                blocking = sum(not c[2] for c in during)
                return (f"{where}: {blocking} of the {len(during)} all-reduces issued while backward ran blocked it "
                        f"(async_op=False, or waited on while layers still computed; {left_running} of {carried} bytes "
                        f"left running): each must be started with async_op=True and waited on once backward's "
                        f"computation is done{missed}")
    return ""


ZERO_DISAGREE = ("the ranks were given the same weights",
                 "every rank must end a step with the parameters each owner updated")


def run_sharded_optimizer(ranks, world_size: int, case: ZeroCase) -> Run:
    """Train with the sharded optimizer (every rank on the whole batch, the case's parameter
    groups); the reports, the finding, and the bytes of state an unsharded optimizer of the same
    class holds after the same steps."""
    g = generator()
    if case.measure_state:
        case = replace(case, width=MEASURED_WIDTH)
    init = random_state("equal", g, case.layers, case.width)
    batches = random_batches(case.steps, g)
    sample = draw_sample({n: v.numel() for n, v in init.items()}, g) if case.measure_state else None
    payload = wire.encode({"case": asdict(case), "init": init, "batches": batches, "sample": sample})
    calibration = memory.calibrated(training.calibrate_sharded_optimizer, world_size, [payload] * world_size) \
        if case.measure_state else []
    reports = ranks(training.train_sharded_optimizer, world_size, [payload] * world_size)
    reference = models.build("equal", case.layers, case.width)
    reference.load_state_dict(init)
    cls, kwargs = models.optimizer_class(case.optimizer)
    optimizer = cls(models.zero_groups(reference, asdict(case)), **kwargs)
    expected = _train(reference, optimizer, batches, _mse, lambda step: models.added_group(reference, asdict(case), step),
                      keep=lambda named: training.sampled(named, sample))
    mismatch = compare(reports, expected, labels(case.steps), ZERO_DISAGREE)
    exclude = {p.untyped_storage().data_ptr() for p in reference.parameters()}
    exclude |= {p.grad.untyped_storage().data_ptr() for p in reference.parameters() if p.grad is not None}
    return Run(reports, mismatch, sum(h.nbytes for h in probes.held_tensors(optimizer, "optimizer", exclude)),
               model_bytes=sum(p.numel() * p.element_size() for p in reference.parameters()), calibration=calibration)



def draw_sample(numels: dict[str, int], g: torch.Generator,
                used_rows: dict[str, tuple[torch.Tensor, int]] | None = None) -> dict[str, torch.Tensor]:
    """``SAMPLED`` flat indices into each tensor larger than that, drawn by the grader (training.sampled).
    ``used_rows`` maps a name to (the rows training moves, a row's length): half that tensor's
    indices fall in those rows. An embedding moves only at its batches' tokens (3.5% of
    MEASURED_LM's rows): a draw over the whole table missed them all about once in 10^4 runs, and
    the reference then "did not move" it, a grader error that failed a correct FSDP's test."""
    out = {n: torch.randint(0, k, (SAMPLED,), generator=g) for n, k in numels.items() if k > SAMPLED}
    for n, (rows, width) in (used_rows or {}).items():
        if n in out:
            half = SAMPLED // 2
            out[n][:half] = rows[torch.randint(0, len(rows), (half,), generator=g)] * width + \
                torch.randint(0, width, (half,), generator=g)
    return out


# The public 26.1.4 tests' tolerances: float32 atol 1e-6, rtol 1e-4; a compute dtype 1e-4 and
# 1e-4, against single-process training cast alike. bfloat16 has no public case, and 3 fewer bits
# of mantissa than float16: at 1e-4 the correct fixture failed once in about 200 runs under load
# (1.4e-4 against 1.2e-4 allowed, after step 2); 5e-4 leaves it four times that, and training
# that is wrong (gradients not averaged) is still far beyond it, and caught in float32 besides.
DTYPE_TOLERANCE = {None: (RTOL, ATOL), "float16": (1e-4, 1e-4), "bfloat16": (5e-4, 5e-4)}
FSDP_DISAGREE = ("", "the full parameters gathered on each rank differ")


def run_fsdp(ranks, world_size: int, case: FSDPCase) -> Run:
    """Train through the FSDP adapters from the grader's initial weights; reports, finding, and
    the bytes of the full parameters."""
    g = generator()
    if case.measure:
        case = replace(case, shape=models.MEASURED_LM)
    if case.traffic:
        case = replace(case, shape=models.TRAFFIC_LM)
    vocab = case.shape.vocab
    batches = [{"ids": torch.randint(0, vocab, (BATCH, 6), generator=g),
                "labels": torch.randint(0, vocab, (BATCH, 6), generator=g)} for _ in range(case.steps)]
    # A measured run's 24 MB of initial weights travel as a seed the grader drew (os.urandom):
    # each rank makes the same tensors from it, before its model is filled (a submission that
    # patched torch's generator only fills its own model wrongly, and fails the comparison).
    seed = int.from_bytes(os.urandom(8), "little") >> 1
    init = models.lm_init(case.shape, torch.Generator().manual_seed(seed) if case.measure else g)
    sample = None
    if case.measure:  # the embedding's sample partly in the rows the batches' tokens use (draw_sample)
        tokens = torch.cat([b["ids"].reshape(-1) for b in batches]).unique()
        sample = draw_sample({k.split(".")[0]: v.numel() for k, v in init.items() if v.dim() == 2}, g,
                             {"embedding": (tokens, case.shape.d_model)})
    job = {"case": {"optimizer": case.optimizer, "shape": asdict(case.shape), "compute_dtype": case.compute_dtype,
                    "measure": case.measure, "traffic": case.traffic}, "sample": sample, **({"init_seed": seed} if case.measure else {"init": init})}
    sent, releases = carried.batches_at_holds(batches, world_size, shard) if case.traffic else (batches, None)
    payloads = [wire.encode({**job, "batches": [shard(b, r, world_size) for b in sent]}) for r in range(world_size)]
    calibration = memory.calibrated(training.calibrate_fsdp, world_size, payloads) if case.measure else []
    reports = ranks(training.train_fsdp, world_size, payloads, releases)
    dtype = getattr(torch, case.compute_dtype) if case.compute_dtype else None
    try:
        reference = models.ReferenceLM(case.shape, init, reports[0]["layout"], dtype)
    except (ValueError, KeyError) as e:
        raise AssertionError(f"rank 0: the model built from cs336_basics' Linear and Embedding: {e}") from e
    del init  # the reference holds its own copy
    optimizer = models.make_optimizer(case.optimizer, reference.parameters())

    def cross_entropy(model, batch):
        return F.cross_entropy(model(batch["ids"]).float().flatten(0, 1), batch["labels"].flatten())

    saved = memory.activation_bytes(reference, shard(batches[0], 0, world_size)["ids"]) if case.measure else 0
    expected = _train(reference, optimizer, batches, cross_entropy, keep=lambda named: training.sampled(named, sample))[1:]
    gathered = [{"params": [training.by_model_names(p, expected[0]) for p in r["params"]]} for r in reports]
    mismatch = compare(gathered, expected, labels(case.steps, construction=False), FSDP_DISAGREE,
                       DTYPE_TOLERANCE[case.compute_dtype])
    weights = {f"{layer}.{layer_.weight_name}": getattr(layer_, layer_.weight_name).numel() * 4
               for layer in models.LM_LAYERS if layer != "norm" for layer_ in [getattr(reference, layer)]}
    full = sum(p.numel() * p.element_size() for p in reference.parameters())
    return Run(reports, mismatch, full, weights=weights, replicated=full - sum(weights.values()), activations=saved,
               calibration=calibration)
