"""Sharding judged from what a rank holds, read by the grader from outside the rank.

Each rank of a measured test pauses (grading/readings/outside.py): once before any of the submission's
code runs, once its modules are imported (the adapters, and for FSDP the course's model module),
then at the points a check names; what a rank *holds* at a pause is its memory there (what the
kernel charges its memory cgroup, rank_cgroups.py, where the grader could make one; else what
every process of its tree holds, outside.py) less its memory once imported. What a submission
does before its model exists (its imports, a compiled function's machinery, plotting libraries,
the course's model package) is never counted as what it stores; what a rank holds after that,
wherever it keeps it (a module global, a helper process, a file or a pipe, the last three only
with a cgroup), is. What a rank holds that is the
grader's (its model, autograd's and gloo's buffers) is measured in the same grading, by ranks
of the grader's own at the same sizes and pauses with no submission code (``calibrated``). The
models are sized so that what each check looks for is many megabytes, several times the spread
of that difference over runs of a correct solution under load (grading/README.md, "How sharding is
measured"); each bound lies halfway between what a correct solution holds and what the weakest
solution it must catch holds.

A reading is one witness. Where another disagrees with it (the charge's parts against the charge
across a bound; the rank's own tensors against a reading over its bound; a rank whose memory
falls below what it held once imported), the check neither caps nor passes: it holds the problem
for a TA's review with both (grading/readings/review.py). A reading beyond its bound by less than
a margin of it holds too: a reading caps only with a margin (grading/readings/bounds.py).

Every finding says the requirement, the megabytes seen against the bound, and what a correct
solution and the weak one would hold, so a TA can check it. The largest tensors the
submission's object reaches, counted inside the rank, follow as a hint, labelled as such.
"""

from __future__ import annotations

import re

import statistics
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from grading.readings import review
from grading.readings.bounds import CAP, MB, crossed, explained, mb, not_capped, witnesses
from grading.readings.outside import BEFORE, IMPORTED, KEY
from grading.problems import named_for
from grading.isolation.ranks import RankFailure, run_ranks
from grading.selfcheck import GRADER_FAILURE

# A rank whose memory falls this far below what it held once imported has given memory back that
# it did not allocate (pages it shares with the fork server, returned with madvise, say): every
# later reading is lowered by as much, so its readings are held for review, not trusted. A
# correct rank's readings stay within 0.1 MB of it (the collection before each pause).
SHRINK_ALLOWANCE = 1 * MB


def judged(run, again: Callable[[], object], finding: Callable[[object], str],
           inside: Callable[[object], str | None]) -> list[str]:
    """A measured check's findings, every witness heard (review.py); ``run`` and what ``again``
    returns are checks.Run, ``finding`` the reading's finding on one, ``inside`` what the ranks'
    own tensors say of the same requirement (a finding, "" where they meet it, None where they
    were not counted).

    A reading over its bound costs points only when a second measured run, made then, finds it
    too (a correct rank's reading was once seen over its bound in about 70 runs of the answers'
    FSDP at 2 ranks, 1.8 MB above its usual at every pause, cause not found); that run is judged
    whole, its training compared with the reference as the first's, so a submission gains nothing
    by knowing which run matters. Where its ranks' own tensors meet the requirement, the reading
    and they disagree: held for review with both; a finding that is a hold already (near its
    bound, or the charge and its parts disagreeing: ``crossed``) stands as the second run made
    it. A reading within its bound is held for review when another witness disagrees: the
    rank's own tensors, a memory that fell below what it held once imported, tensors its modules
    made at import, shared memory it maps, or a source that reaches for what can make a reading
    lie."""
    first = finding(run)
    if first:
        rerun = again()
        second, said = finding(rerun), inside(rerun)
        if second and said == "" and not review.is_held(second):
            return [rerun.mismatch, review.held("the reading from outside and the rank's own tensors disagree",
                                                f"outside: {second}", f"inside: {inside_summary(rerun.reports)}",
                                                review.witnessed(rerun.reports))]
        return [second, rerun.mismatch]
    witnesses = [inside(run), shrank(run.reports), imported(run.reports), shared(run.reports),
                 review.witnessed(run.reports)]
    if any(witnesses):
        return [review.held("the reading from outside is within its bound, but another witness disagrees",
                            f"outside: {outside_summary(run.reports)}", *witnesses)]
    return []


def inside_summary(reports: list[dict]) -> str:
    return ", ".join(f"rank {r} reaches {mb(report['inside'])} of tensors" + (
        f" (its weights: {mb(report['inside_weights'])})" if isinstance(report.get("inside_weights"), int) else "")
                     for r, report in enumerate(reports) if isinstance(report.get("inside"), int)) or "not counted"


def outside_summary(reports: list[dict]) -> str:
    """The least each rank held after its steps, beyond what it held once imported."""
    parts = []
    for rank, report in enumerate(reports):
        steps = held(report, rank, "after step")
        parts.append(f"rank {rank} {steps}" if isinstance(steps, str)
                     else f"rank {rank} holds {mb(min(b for _, b in steps))} after its steps")
    return ", ".join(parts)


def imported(reports: list[dict]) -> str:
    """The witness of tensors and buffers the submission's modules made at import and wrote to
    later (training.imported_tensors, imported_since): one that stays as made (a constant mask)
    holds no state, and witnesses nothing."""
    for rank, report in enumerate(reports):
        changed = report.get("imported_changed", [])
        if "imported_changed" in report and not changed:
            continue
        if isinstance(report.get("imported"), int) and report["imported"] > SHRINK_ALLOWANCE:
            written = f"; written to since: {', '.join(changed)}" if changed else ""
            return (f"rank {rank}'s modules hold {mb(report['imported'])} of tensors and buffers once imported, before "
                    f"any model exists (largest: {report.get('imported_largest', '')}){written}; memory made then is "
                    "not read as stored")
    return ""


def inside_state(reports: list[dict], full_state: int, side: str) -> str | None:
    """What the ranks' own tensors (the optimizer's state, counted inside) say of the state's
    sharding, from ``side`` as state_finding."""
    counts = [r.get("inside") for r in reports]
    if not all(isinstance(c, int) for c in counts):
        return None
    high, low = state_bounds(full_state, len(reports))
    for rank, count in enumerate(counts):
        if side == "over" and count > high:
            return f"rank {rank}'s optimizer reaches {mb(count)} of state, over {mb(high)}"
        if side == "under" and count < low:
            return f"rank {rank}'s optimizer reaches {mb(count)} of state, under {mb(low)}"
    return ""


def inside_weights(reports: list[dict], weights: dict[str, int], replicated: int) -> str | None:
    """What the ranks' own tensors say of its weights' sharding: its weights (the FSDP's
    parameters and the tensors its layers hold, training.weights_inside; where not counted, all
    the FSDP object reaches) over 1/ws of every weight, the replicated parameters and half a
    weight kept whole is not sharded. Buffers beside the weights are not weights: an FSDP that
    keeps each reduce-scatter's work handle, and its full gradient, until the next forward holds
    them between steps with every weight at 1/ws; the reading from outside counts them, and the
    two witnesses disagreeing hold it for review (it was capped as "weights not sharded")."""
    ws = len(reports)
    counts = [r.get("inside_weights", r.get("inside")) for r in reports]
    if not all(isinstance(c, int) for c in counts):
        return None
    bound = sum(weights.values()) / ws + replicated + min(weights.values()) * (1 - 1 / ws) / 2
    for rank, count in enumerate(counts):
        if count > bound:
            return f"rank {rank}'s weights come to {mb(count)}, counted inside it, over {mb(bound)}"
    return ""


def held(report: dict, rank: int, prefix: str, key: str = "bytes") -> list[tuple[str, int]] | str:
    """(label, bytes held) at each pause whose label starts with ``prefix``, beyond what the rank
    held once the submission's modules were imported (its first pause for the grader's own
    ranks, which import nothing), by the witness ``key`` of each reading (``WITNESSES``); or the
    finding that a pause was not read (the rank did not stop: its memory could not be read from
    outside)."""
    readings = report.get(KEY) or []
    broken = [r["grader_error"] for r in readings if r.get("grader_error")]
    if broken:
        return f"grader error, not the submission's: {broken[0]}; its memory could not be read, so this check cannot tell"
    if any(r["label"] == "too many pauses" for r in readings):
        return f"rank {rank} sent more pause frames than the suite makes: its memory could not be read"
    unread = [r["label"] for r in readings if "bytes" not in r]
    if unread:
        return (f"rank {rank} did not stop at the grader's pause '{unread[0]}' (the rank stops itself with SIGSTOP "
                "while the grader reads its memory from outside): its memory could not be read")
    if (wrong := out_of_protocol([r["label"] for r in readings])) is not None:
        return (f"rank {rank} sent pause frames the suite does not make ({wrong}): its memory could not be read "
                "(a pause is the suite's, once each, in its order)")
    if any(key not in r for r in readings):
        return f"rank {rank}'s readings have no '{key}'"
    base = [r for r in readings if r["label"] == BEFORE]
    start = ([r[key] for r in readings if r["label"] == IMPORTED] + [r[key] for r in base])[:1]
    found = [(r["label"], r[key] - start[0]) for r in readings if r["label"].startswith(prefix)] if start else []
    if len(base) != 1 or not found:
        return f"rank {rank} reported {len(readings)} pauses, not the ones the suite makes: its memory could not be read"
    return found


_STEP = re.compile(r"(after step|between forward and backward of step) ([1-9][0-9]*)$")


def out_of_protocol(labels: list[str]) -> str | None:
    """The first pause label out of the suite's protocol, or None: BEFORE first, IMPORTED at most
    once after it, then per step k = 1, 2, ... (in order) at most one "between forward and
    backward of step k" before one "after step k". A rank runs the suite's code beside the
    submission's, which can send pause frames of its own (an "after step 0" made before any
    state exists was read as the least, once): the grader reads only the suite's."""
    if not labels:
        return None  # no pause at all: held() says so
    if labels[0] != BEFORE:
        return labels[0]
    last, rest = (0, 1), labels[1:]
    if rest and rest[0] == IMPORTED:
        rest = rest[1:]
    for label in rest:
        match = _STEP.match(label)
        if match is None:
            return label
        here = (int(match.group(2)), 1 if match.group(1) == "after step" else 0)
        if here <= last:  # a step's pauses in order, none twice
            return label
        last = here
    return None


def shrank(reports: list[dict]) -> str:
    """A second witness to the readings: the first rank whose memory fell more than
    ``SHRINK_ALLOWANCE`` below what it held before the submission's code ran or once it was
    imported, with the readings; "" if none did."""
    for rank, report in enumerate(reports):
        readings = [r for r in report.get(KEY) or [] if "bytes" in r]
        first = {r["label"]: r["bytes"] for r in readings if r["label"] in (BEFORE, IMPORTED)}
        if len(first) < 2:
            continue
        if first[IMPORTED] < first[BEFORE] - SHRINK_ALLOWANCE:
            return (f"rank {rank}'s memory fell from {mb(first[BEFORE])} before its code ran to {mb(first[IMPORTED])} "
                    "once it was imported")
        later = [r for r in readings if r["label"] not in (BEFORE, IMPORTED)]
        low = min(later, key=lambda r: r["bytes"], default=None)
        if low is not None and low["bytes"] < first[IMPORTED] - SHRINK_ALLOWANCE:
            return (f"rank {rank}'s memory fell to {mb(low['bytes'])} ({low['label']}) below the {mb(first[IMPORTED])} "
                    "it held once imported")
    return ""


def shared(reports: list[dict]) -> str:
    """A witness from the kernel: the first rank whose processes map more than
    ``SHRINK_ALLOWANCE`` of shared memory (``RssShmem``) once its submission was imported, with
    the reading; "" if none does. Shared memory mapped before the baseline (a declared package's
    arena at import: issue 57's route 3) is in the baseline, so what is later kept in it is in no
    reading; and a shared mapping can reach beyond the rank. A correct rank maps none."""
    for rank, report in enumerate(reports):
        for reading in report.get(KEY) or []:
            if reading.get("label") != BEFORE and reading.get("shmem", 0) > SHRINK_ALLOWANCE:
                return (f"rank {rank}'s processes map {mb(reading['shmem'])} of shared memory ({reading['label']}; "
                        "RssShmem): memory mapped before its baseline holds what no reading sees")
    return ""


def calibrated(fn, world_size: int, payloads: list[bytes], cache: dict = {}) -> list[dict]:  # noqa: B006
    """The grader's own ranks at a measured run's sizes and pauses (training.calibrate_*), their
    memory read as the measured ranks' is: once per world size in this grading (``cache``: this
    process's), before its first measured run, so that what a rank's first touch of shared code
    and files charges falls here too. No submission code runs in them: their failure is the
    grader's (the grading stops, no grade written), never the submission's."""
    key = (fn.__name__, world_size)
    if key not in cache:
        try:
            cache[key] = run_ranks(fn, world_size, payloads)
        except RankFailure as failure:
            pytest.fail(f"{GRADER_FAILURE}the grader's own ranks, which measure what a rank keeps without a "
                        f"submission, failed: {failure.reason}", pytrace=False)
    return cache[key]


def grader_keeps(calibration: list[dict], prefix: str, key: str = "bytes") -> int | str:
    """What the grader's own ranks (``calibrated``) hold at the pauses whose label starts with
    ``prefix``, beyond their first pause: the median over ranks and pauses (a buffer in flight at
    one pause moves it little), in bytes; or why it could not be read (a grader error: the check
    cannot tell)."""
    found = []
    for rank, report in enumerate(calibration):
        steps = held(report, rank, prefix, key)
        if isinstance(steps, str):
            return f"grader error, not the submission's: the grader's own rank could not be read ({steps})"
        found += [b for _, b in steps]
    return int(statistics.median(found)) if found else "grader error, not the submission's: no calibration readings"


def how_read(reports: list[dict]) -> str:
    """How the readings were taken, as a finding says it: the rank's memory cgroup or its resident memory."""
    sources = {r.get("source") for report in reports for r in report.get(KEY) or [] if "bytes" in r}
    if sources and sources <= {"cgroup v1", "cgroup v2"}:
        return f"read from outside the rank: its memory cgroup's charge, {'/'.join(sorted(sources))}"
    return "read from outside the rank: the resident memory of its processes"


def _hint(report: dict) -> str:
    lines = report.get("hint") or []
    return f" [hint, counted inside the rank: largest {'; '.join(map(str, lines[:3]))}]" if lines else ""


# Bounds on a rank's optimizer state as a fraction of the unsharded optimizer's: above 1/ws by at
# most this much (a split by whole tensors), and at least this fraction of 1/ws (none left empty).
STATE_OVER = 0.25
STATE_FLOOR = 1 / 3


def state_bounds(full_state: int, ws: int) -> tuple[float, float]:
    """The most and the least optimizer state one of ``ws`` ranks may keep (``STATE_OVER``,
    ``STATE_FLOOR``): the one rule for the reading from outside and the ranks' own tensors."""
    return full_state * (1 / ws + STATE_OVER), full_state / ws * STATE_FLOOR


def state_finding(reports: list[dict], full_state: int, model_bytes: int, problem: str, side: str,
                  calibration: list[dict] | None = None) -> str:
    """Every rank keeps about 1/world size of the optimizer state, from one ``side``: "over", at
    most 1/ws + ``STATE_OVER`` of the unsharded state (least over the steps from step 2: a buffer
    in flight at one pause is not state); "under", at least ``STATE_FLOOR`` of 1/ws (most over the steps). What
    a rank holds beyond what the grader's own training holds at the same pauses (``calibration``,
    its model and buffers; without it, the model's parameters, ``model_bytes``: gradients are
    dropped before each pause) is its state, by each witness (``crossed``). "" or the first
    rank's finding (a cap, or a hold for review), ending with ``named_for(problem)``."""
    ws = len(reports)
    high, low = state_bounds(full_state, ws)
    bound = high if side == "over" else low
    kinds = witnesses(reports + list(calibration or []))
    baselines: dict[str, tuple[int, str]] = {}
    for key in kinds:
        kept = grader_keeps(calibration, "after step", key) if calibration else model_bytes
        if isinstance(kept, str):
            return f"{kept} {named_for(problem)}"
        baselines[key] = (kept, f"the {mb(kept)} the grader's own training holds there (its model; measured in this run)"
                          if calibration else f"the model's {mb(kept)}")
    read = how_read(reports)
    for rank, report in enumerate(reports):
        judged_at = {}
        for key in kinds:
            steps = held(report, rank, "after step", key)
            if isinstance(steps, str):
                return f"{steps} {named_for(problem)}"
            state = [(label, b - baselines[key][0]) for label, b in steps]
            # "over" judges the least from step 2 on: AdamW's state after step 1 is a function of the
            # first gradient alone, which a rank may keep in its place (half the bytes) and expand at
            # step 2, bit for bit; no later state is a function of less than itself.
            judged_at[key] = min(state[1:] or state, key=lambda s: s[1]) if side == "over" else \
                max(state, key=lambda s: s[1])
        verdict = crossed({k: (v, bound) for k, (_, v) in judged_at.items()}, side)
        if not verdict:
            continue
        (label, value), baseline = judged_at["bytes"], baselines["bytes"][1]
        if side == "over":
            message = (f"rank {rank} holds {mb(value)} beyond {baseline} at every pause (least: "
                       f"{label}), {value / full_state:.0%} of the {mb(full_state)} the unsharded optimizer keeps "
                       f"({read}{explained(report, label)}; sharded over {ws} ranks: about {mb(full_state / ws)}, at "
                       f"most {mb(high)}): the optimizer state is not sharded {named_for(problem)}{_hint(report)}")
        else:
            message = (f"rank {rank} holds at most {mb(value)} beyond {baseline} ({label}; {read}{explained(report, label)}) "
                       f"while each of {ws} ranks should keep about 1/{ws} of the {mb(full_state)} of optimizer state "
                       f"({mb(full_state / ws)}; at least {mb(low)}): this rank was given no share of the parameters "
                       f"(a partition written for another world size?) {named_for(problem)}{_hint(report)}")
        return message if verdict == CAP else not_capped(rank, {k: (v, bound) for k, (_, v) in judged_at.items()},
                                                         side, message)
    return ""


# What a correct FSDP rank keeps after a step beyond its shards, whatever the model's size: the
# training loop's, autograd's and gloo's own (thread stacks, small buffers) and the submission's
# imports. 1.1 to 1.3 MB for the correct fixture at 2 and 3 ranks, 12 and 24 MB of shards.
TRAINING_KEEPS = int(1.2 * MB)


def weights_finding(reports: list[dict], weights: dict[str, int], replicated: int, problem: str,
                    calibration: list[dict] | None = None) -> str:
    """Each Linear and Embedding weight held at 1/world size between steps, checked weight by
    weight: the model's weights are of one size (models.MEASURED_LM), so one weight kept whole
    adds ``w·(1 - 1/ws)``, and the bound lies halfway between that and a fully sharded rank
    (1/ws of every weight, the replicated parameters whole, and what the training keeps beyond
    its weights: ``TRAINING_KEEPS``, or more where the grader's own plain model keeps more,
    ``calibration``, measured in this run, by each witness). The least over the steps is judged."""
    ws = len(reports)
    total = sum(weights.values())
    one_whole = min(weights.values()) * (1 - 1 / ws)
    kinds = witnesses(reports + list(calibration or []))
    keeps: dict[str, float] = {}
    for key in kinds:
        keeps[key] = TRAINING_KEEPS
        if calibration:
            plain = grader_keeps(calibration, "after step", key)
            if isinstance(plain, str):
                return f"{plain} {named_for(problem)}"
            keeps[key] = max(TRAINING_KEEPS, plain - total - replicated)
    bounds = {key: total / ws + replicated + keeps[key] + one_whole / 2 for key in kinds}
    read = how_read(reports)
    for rank, report in enumerate(reports):
        judged_at = {}
        for key in kinds:
            steps = held(report, rank, "after step", key)
            if isinstance(steps, str):
                return f"{steps} {named_for(problem)}"
            judged_at[key] = min(steps, key=lambda s: s[1])
        found = {k: (v, bounds[k]) for k, (_, v) in judged_at.items()}
        verdict = crossed(found, "over")
        if not verdict:
            continue
        (label, least), bound = judged_at["bytes"], bounds["bytes"]
        message = (f"rank {rank} holds {mb(least)} between steps (least: {label}; {read}{explained(report, label)}), "
                   f"over the {mb(bound)} allowed: 1/{ws} of each Linear and Embedding weight comes to {mb(total / ws)} "
                   f"(+ {mb(replicated)} replicated, + {mb(keeps['bytes'])} the training keeps), and any one of "
                   f"{', '.join(weights)} ({mb(min(weights.values()))} each) kept whole adds {mb(one_whole)}: weights "
                   f"are not sharded {named_for(problem)}{_hint(report)}")
        return message if verdict == CAP else not_capped(rank, found, "over", message)
    return ""


# What the gathered-weights finding starts with: the handout's requirement, in its words.
FREED_HANDOUT = ('the gathered weights are not freed after use (handout: "Make sure to free the gathered weights after '
                 'use"; "In the backward pass, ... all-gather to have the weights available for the computation")')


def freed_finding(reports: list[dict], weights: dict[str, int], activations: int, problem: str) -> str:
    """Between forward and backward a rank holds what it held after the step before, the
    activations saved for backward, and at most one gathered weight in flight (a prefetch): the
    handout's "free the gathered weights after use"; a second gathered weight kept means backward
    does not gather again. The bound lies halfway between one and two weights kept; the least
    over steps 2 on is judged (step 1 may make what later steps keep), by each witness."""
    one = max(weights.values())
    bound = 1.5 * one
    kinds = witnesses(reports)
    for rank, report in enumerate(reports):
        judged_at = {}
        for key in kinds:
            between, after = held(report, rank, "between forward", key), held(report, rank, "after step", key)
            for found in (between, after):
                if isinstance(found, str):
                    return f"{found} {named_for(problem)}"
            if len(between) < 2 or len(after) < len(between) - 1:
                return (f"rank {rank} reported {len(between)} pauses between forward and backward: too few to judge "
                        f"{named_for(problem)}")
            more = [(label, b - a) for (label, b), (_, a) in zip(between[1:], after)]
            judged_at[key] = min(more, key=lambda s: s[1])
        found = {k: (v - activations, bound) for k, (_, v) in judged_at.items()}
        verdict = crossed(found, "over")
        if not verdict:
            continue
        (label, added) = judged_at["bytes"]
        extra = added - activations
        message = (f"{FREED_HANDOUT}: rank {rank} holds {mb(added)} more between forward and backward ({label}) than "
                   f"after the step before; the activations saved for backward are about {mb(activations)}, so "
                   f"{mb(extra)} is kept, about {extra / one:.1f} gathered weights of {mb(one)} (at most one in flight "
                   f"allowed, bound {mb(bound)}){_hint(report)}")
        return message if verdict == CAP else not_capped(rank, found, "over", message)
    return ""


def activation_bytes(reference: torch.nn.Module, ids: torch.Tensor) -> int:
    """What one rank's forward keeps for backward, as single-process training on its shard keeps
    it: the tensors autograd saves that are not parameters, and the logits."""
    params = {p.untyped_storage().data_ptr() for p in reference.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = reference(ids)
        F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    return sum(saved.values()) + logits.untyped_storage().nbytes()
