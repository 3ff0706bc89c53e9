"""What an FSDP or DDP step carried, phase by phase, against what gloo's own collectives carry.

The bytes are the kernel's (grading/readings/traffic.py: the loopback of the run's own network namespace,
read while every rank is held). What they should be is measured, not assumed: ``calibrate``
runs the grader's own collective loop (``collective_loop``: no submission code runs in it) on
tensors of the test's weights' sizes, at the test's world size, in the same namespace, and
records the bytes per payload byte of an all-gather, a reduce-scatter and an all-reduce. gloo
picks its algorithms by size and world size, and TCP adds its headers: both are in the reading.

An FSDP step, as the handout states it, in those units (S: the Linear and Embedding weights'
float32 bytes; d: the compute dtype's size over float32's, 1 without one):

* forward: all-gathers every weight, cast to the compute dtype first: ``all_gather(S·d)``;
* backward: all-gathers again what backward needs (at most what forward gathered), and
  reduce-scatters the gradients: ``reduce_scatter(S)`` (or less, in the compute dtype). A ring's
  reduce-scatter carries half of its all-reduce; gloo's carries all of it (``SCATTER_TELLS``), so
  on gloo the bytes hold the backward to one reduction of the gradients, and cannot tell a
  reduce-scatter from an all-reduce.

A DDP step (``ddp_finding``) carries one all-reduce of every gradient, and, when the gradients
overlap backward, those of the layers above the grader's probe before backward reaches it.

The limits lie halfway between the right way and the wrong one, so that neither a padding
nor a different prefetch depth or bucket size nor the rounding of gloo's chunks moves a right
solution across them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from grading.readings import review, traffic
from grading.isolation import wire
from grading.problems import named_for
from grading.isolation.ranks import Rank

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# The calibration's tiny all-reduces (one float each): what a packet carries beyond its payload
# (IP and TCP headers, gloo's per-message header, the acknowledgements), in bytes per packet.
TINY = 200
# gloo's reduce_scatter_tensor carries what its all_reduce carries (measured in a namespace like the
# grader's: 2.003 and 2.003 bytes per payload byte at 2 ranks, 4.007 and 4.006 at 3; all_gather
# 1.002 and 2.004): on gloo the bytes cannot tell them apart, and the backward is held to one
# reduction of the gradients instead. A backend whose reduce-scatter carries under 3/4 of its
# all-reduce (a ring's half) is held to the halfway limit.
SCATTER_TELLS = 0.75
_calibrated: dict[tuple[int, tuple[int, ...]], dict[str, float]] = {}  # per grader process
HANDOUT_SCATTER = ('the handout: the FSDP wrapper "will handle weight all-gathers and gradient reduce-scatters"')
HANDOUT_CAST = ('the handout: "When compute_dtype is provided, cast the weights to that dtype before communicating '
                'or using them for compute"')


def collective_loop(ctx: Rank, job: dict) -> dict:
    """Rank side, the grader's own code only: each kind of collective over float32 tensors of
    ``job["numels"]`` elements, the group held before and after each kind."""
    import torch.distributed as dist

    n = ctx.world_size
    tensors = [torch.randn(numel) for numel in job["numels"]]
    ctx.hold("calibration: start")
    for t in tensors:
        dist.all_gather_into_tensor(torch.empty_like(t), t[:t.numel() // n].contiguous())
    ctx.hold("calibration: all_gather")
    for t in tensors:
        dist.reduce_scatter_tensor(torch.empty(t.numel() // n), t)
    ctx.hold("calibration: reduce_scatter")
    for t in tensors:
        dist.all_reduce(t)
    ctx.hold("calibration: all_reduce")
    for _ in range(TINY):
        dist.all_reduce(torch.zeros(1))
    ctx.hold("calibration: tiny")
    return {}


def calibrate(ranks, world_size: int, numels: list[int]) -> dict[str, float]:
    """Loopback bytes per payload byte of each kind (``KINDS``) at ``world_size``, measured once
    per grader process for these sizes."""
    key = (world_size, tuple(numels))
    if key not in _calibrated:
        reports = ranks(collective_loop, world_size, [wire.encode({"numels": numels})] * world_size)
        labels = ["calibration: start", *(f"calibration: {k}" for k in KINDS), "calibration: tiny"]
        readings = phases(reports[0].get("traffic", []), labels)
        packets = phases(reports[0].get("traffic", []), labels, "packets")
        if isinstance(readings, str) or isinstance(packets, str):
            raise RuntimeError(f"grader error: the calibration's holds: {readings if isinstance(readings, str) else packets}")
        payload = 4 * sum(numels)
        _calibrated[key] = {kind: carried / payload for kind, carried in zip(KINDS, readings)}
        _calibrated[key]["all_reduce_packets"] = packets[2]
        _calibrated[key]["packet"] = readings[3] / max(1, packets[3])
    return _calibrated[key]


def phases(readings: list[dict], labels: list[str], count: str = "bytes") -> list[int] | str:
    """The bytes (or with ``count="packets"``, the packets) carried between consecutive
    ``labels``, from the grader's readings at holds; a sentence instead when the holds were not
    the suite's (an error at one, a label missing, repeated or out of order)."""
    errors = [r for r in readings if "error" in r]
    if errors:
        return f"hold {errors[0]['label']!r}: {errors[0]['error']}"
    seen = [r["label"] for r in readings]
    if seen != labels:
        return f"the ranks held at {seen}, where the suite holds at {labels}"
    counts = [r.get(count, 0) for r in readings]
    return [b - a for a, b in zip(counts, counts[1:])]


def batches_at_holds(batches: list[dict[str, torch.Tensor]], world_size: int, shard) -> tuple[list, dict]:
    """A traffic run's data: zeros of each batch's shape in the ranks' job, and each rank's shard
    (``shard(batch, rank, world_size)``) sent with the release of the step's "before forward" hold,
    so that no step can start before the grader has read the loopback there (training.released_batch)."""
    placeholders = [{k: torch.zeros_like(v) for k, v in b.items()} for b in batches]
    releases = {f"before forward of step {s}": [wire.encode(shard(b, r, world_size)) for r in range(world_size)]
                for s, b in enumerate(batches, 1)}
    return placeholders, releases


def fsdp_labels(steps: int) -> list[str]:
    """The holds of training.train_fsdp with ``traffic``, in order."""
    return [f"{where} of step {s}" for s in range(1, steps + 1)
            for where in ("before forward", "between forward and backward", "after backward")]


def mb(n: float) -> str:
    return f"{n / 1e6:.3f} MB"


# The rank's own record of its gathers (training.train_fsdp's ``gathers``, from the collective
# log) explains a forward's loopback bytes when they are at most this much above what gloo
# carries for the gathers it records: the calibration's bytes per payload byte, and headers.
LOG_AGREES = 1.1


def logged_gathers(reports: list[dict], step: int, dtype: str) -> tuple[int, int] | None:
    """The bytes of the all-gathers step ``step`` (0-based) issued in forward and in backward, by
    rank 0's own record, where every rank's record of that step has gathers and all of them in
    ``dtype``; None otherwise. An FSDP that casts to the compute dtype and then gathers some
    layers twice (a prefetch it gathers again) carries as many bytes as one gathering in float32:
    the bytes alone cannot tell them apart, and read it as float32; the dtype the gathers carried
    can (a gather the log does not see, on the group's own object, leaves bytes it does not explain)."""
    found = []
    for report in reports:
        steps = report.get("gathers") or []
        if step >= len(steps) or not steps[step][0]:
            return None
        if any(kind != dtype for phase in steps[step] for _, kind in phase):
            return None
        found.append(tuple(sum(n for n, _ in phase) for phase in steps[step]))
    return found[0] if found else None


def fsdp_finding(reports: list[dict], calibration: dict[str, float], weights: int, compute_dtype: str | None,
                 steps: int) -> str:
    """Whether every step's forward all-gathered the weights in the compute dtype and its backward
    reduce-scattered the gradients, by the loopback's bytes (``weights``: the Linear and Embedding
    weights' float32 bytes). The first step is not judged: a wrapper may build its state lazily
    there (a broadcast, a first gather). A step followed by another is also judged whole, from
    its "before forward" hold to the next one: the grader sends each step's batch with that
    hold's release, so no byte of a step can be moved out of it (its forward and backward holds,
    signalled from the rank, can be moved within it). "" when they did; else the first phase that
    did not, its bytes, and the limits it was held to."""
    between = phases(reports[0].get("traffic", []), fsdp_labels(steps))
    if isinstance(between, str):
        return f"the loopback's bytes could not be attributed to forward and backward: {between}"
    d = 0.5 if compute_dtype in ("float16", "bfloat16") else 1.0
    gather = calibration["all_gather"] * weights
    scatter, reduce = calibration["reduce_scatter"] * weights, calibration["all_reduce"] * weights
    dtype = compute_dtype or "float32"
    for step in range(1, steps):
        forward, backward = between[3 * step], between[3 * step + 1]
        where = f"step {step + 1}"
        if forward < 0.5 * gather * d:
            return (f"{where}: the forward carried {mb(forward)} over the ranks' loopback, under half of what "
                    f"all-gathering the Linear and Embedding weights in {dtype} carries ({mb(gather * d)}): the "
                    "weights were not all-gathered through the process group")
        # A forward over 3/4 of the float32 gather gathers in float32, or prefetches backward's
        # first gathers (in the compute dtype: a public student's FSDP prefetches two layers
        # ahead); forward and backward together tell them apart (two gathers in float32 and a
        # reduction, or two in the compute dtype and a reduction, held halfway), unless backward
        # gathers nothing: a forward of 9/10 of the float32 gather or more is read as float32
        # (a bfloat16 forward reaches it only by prefetching 4/5 of backward's gathers).
        logged = logged_gathers(reports, step, dtype)
        cast_first = logged is not None and forward <= LOG_AGREES * calibration["all_gather"] * logged[0]
        if d < 1 and not cast_first and (forward > 0.9 * gather
                                         or (forward > 0.75 * gather and forward + backward > (1 + d) * gather + scatter)):
            return (f"{where}: the forward carried {mb(forward)} over the ranks' loopback, and forward and backward "
                    f"{mb(forward + backward)}, where all-gathering the Linear and Embedding weights in {dtype} "
                    f"carries {mb(gather * d)} and in float32 {mb(gather)} (twice a step, with the gradients' reduction "
                    f"{mb(scatter)}): the weights were all-gathered in float32, not cast to {dtype} before ({HANDOUT_CAST})")
        again = min(forward, gather * d)  # backward gathers at most what forward did
        if scatter < SCATTER_TELLS * reduce:  # the bytes tell a reduce-scatter from an all-reduce
            limit = again + (scatter + reduce) / 2
            if backward > limit:
                return (f"{where}: the backward carried {mb(backward)} over the ranks' loopback; gathering the "
                        f"weights again ({mb(again)} at most, what the forward carried) and reduce-scattering the "
                        f"gradients ({mb(scatter)}) carries {mb(again + scatter)}, and all-reducing them {mb(reduce)} "
                        f"instead: the gradients were all-reduced, not reduce-scattered (over {mb(limit)}, halfway; "
                        f"{HANDOUT_SCATTER})")
        elif backward > again + 1.5 * scatter:
            return (f"{where}: the backward carried {mb(backward)} over the ranks' loopback; gathering the weights "
                    f"again ({mb(again)} at most, what the forward carried) and reduce-scattering the gradients once "
                    f"({mb(scatter)}) carries {mb(again + scatter)}: the gradients were sent more than once "
                    f"({HANDOUT_SCATTER})")
        if backward < 0.5 * scatter * d:
            return (f"{where}: the backward carried {mb(backward)} over the ranks' loopback, under half of what "
                    f"reduce-scattering the gradients in {dtype} carries ({mb(scatter * d)}): the gradients did not "
                    "leave the rank through the process group")
        if 3 * step + 2 < len(between):  # the whole step, to the next step's forward
            whole = forward + backward + between[3 * step + 2]
            reduction = (scatter + reduce) / 2 if scatter < SCATTER_TELLS * reduce else 1.25 * scatter
            # two gathers in the compute dtype, the gradients' reduction, the suite's own float32
            # gather of the full parameters for its comparison (fsdp_gather_full_params)
            gathers = 2 * gather * d
            if cast_first:  # gathers in the compute dtype, as many as the rank's own record says
                gathers = max(gathers, LOG_AGREES * calibration["all_gather"] * sum(logged))
            limit = gathers + reduction + gather
            if whole > limit:
                return (f"{where}: the ranks carried {mb(whole)} over their loopback from this step's forward to the "
                        f"next one's; all-gathering the weights in {dtype} for forward and backward "
                        f"({mb(2 * gather * d)}), reducing the gradients ({mb(scatter)}) and gathering the full "
                        f"parameters in float32 for the grader ({mb(gather)}) carry {mb(2 * gather * d + scatter + gather)}"
                        f" (limit {mb(limit)}): the weights were gathered in a wider dtype or the gradients sent "
                        f"more than once ({HANDOUT_CAST}; {HANDOUT_SCATTER})")
    return ""


def ddp_labels(steps: int) -> list[str]:
    """The holds of training.train_ddp with ``traffic``, in order."""
    return [f"{where} of step {s}" for s in range(1, steps + 1)
            for where in ("before forward", "backward reached the first layer", "after backward")]


HANDOUT_OVERLAP = ('the handout: "all-reduce parameter gradients as soon as they\'re ready, reducing the overhead of '
                   'data parallel training by overlapping computation of the backward pass with communication of gradients"')


# The overlap check's fractions: by the probe, at least EARLY of the later layers' all-reduce (the
# pass mark; the rank waits there for that much, never more: training._Gate); over the step at most
# 1.5 all-reduces of every gradient. Bytes sent ahead of the probe to pass the first (EARLY of
# nearly all the gradients) and the real reduction after (one) come to more than 1.5.
EARLY = 0.7


def ddp_finding(reports: list[dict], calibration: dict[str, float], above: int, total: int, steps: int,
                problem: str) -> str:
    """Whether every step after the first (a bucketed wrapper may build its buckets then) carried
    the gradients of the layers above the probe before backward reached the first layer, and
    carried the gradients once: at least half of all-reducing the ``above`` bytes by then, at
    most halfway from one all-reduce of every gradient (``total`` bytes) to two over the step."""
    between = phases(reports[0].get("traffic", []), ddp_labels(steps))
    packets = phases(reports[0].get("traffic", []), ddp_labels(steps), "packets")
    missed = f"; gradients do not overlap backward {named_for(problem)}"
    if isinstance(between, str) or isinstance(packets, str):
        return f"the loopback's bytes could not be attributed to backward: {between if isinstance(between, str) else packets}{missed}"
    once, early_needed = calibration["all_reduce"] * total, calibration["all_reduce"] * above
    for step in range(1, steps):
        early, late = between[3 * step], between[3 * step + 1]
        # and what crossed before the next step's forward (nothing, for a wrapper whose
        # synchronisation ends in ddp_on_after_backward): the grader sends each step's batch with
        # that hold's release, so no byte of the step can be held back past it
        late += between[3 * step + 2] if 3 * step + 2 < len(between) else 0
        sent = sum(packets[3 * step:3 * step + 3])
        # A wrapper that sends the gradients in more, smaller messages than one all-reduce per
        # gradient (chunks smaller than a bucket) pays each packet's headers: counted from
        # outside, they are not gradients sent twice.
        headers = max(0, sent - calibration.get("all_reduce_packets", sent)) * calibration.get("packet", 0)
        where = f"step {step + 1}"
        if early < EARLY * early_needed:
            return (f"{where}: when backward reached the first layer, the ranks had carried {mb(early)} over their "
                    f"loopback, under {EARLY:.0%} of all-reducing the gradients of the layers above it "
                    f"({mb(early_needed)}): "
                    f"the gradients ready were not sent while backward ran ({HANDOUT_OVERLAP}){missed}")
        if early + late - headers > 1.5 * once:
            return (f"{where}: the ranks carried {mb(early + late)} over their loopback from forward to the next "
                    f"step's forward ({mb(headers)} of it the headers of {sent} packets, more than the "
                    f"{calibration.get('all_reduce_packets', 0):.0f} of one all-reduce per gradient), where all-reducing "
                    f"every gradient once carries {mb(once)}: what "
                    f"was sent during backward did not average the gradients, they were sent again after "
                    f"({HANDOUT_OVERLAP}){missed}")
    return ""


def ddp_overlap_finding(ranks, case, problem: str) -> tuple[str, str]:
    """The overlap judged from outside, in the run's own network namespace: the wrapper trains the
    wide model (1 MiB of gradients above the probe) with the group held at the probe; its
    finding and the run's training mismatch. ("", "") where the loopback is not the run's own:
    the check inside the rank (checks.overlap_finding) decides alone there."""
    from grading.suite import checks, models

    if not traffic.private():
        return "", ""
    model = models.build("wide")
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    calibration = calibrate(ranks, 2, sizes)
    above, total = models.above_probe_bytes(model), 4 * sum(sizes)
    # the rank waits at the probe until the check's pass mark of it has gone (honest asynchronous
    # all-reduces get there in milliseconds), or its own collectives are done
    expected = {"above": int(EARLY * calibration["all_reduce"] * above) + 1}
    run = checks.run_ddp(ranks, 2, replace(case, model="wide", traffic=expected))
    finding = ddp_finding(run.reports, calibration, above, total, case.steps, problem)
    if not finding and (witnessed := review.witnessed(run.reports)):
        # bytes that do not cross the loopback (a socket of its own in the abstract namespace, a
        # shared map, a helper process) are in no reading: the loopback's bytes and its code disagree
        finding = review.held("the bytes read from the loopback meet the requirement, but its code opened a way to "
                              "move bytes that the loopback does not carry", witnessed)
    return finding, run.mismatch
