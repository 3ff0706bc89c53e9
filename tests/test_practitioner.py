"""A practitioner's script (tests/practitioner_cases.py) trains the same on ours as on torch's.

One spawned group of 2 gloo ranks runs the script on our ``fully_shard`` and torch's, and on
each of our DDP wrappers and torch's DDP; this process runs it once on the global batch. Each
side must see what one process sees (as many decayed parameters, the same parameter count and
gradient norms before clipping) and end every step with the one process's weights. Tolerance:
float32 rounding of a different summation order, 1e-6 per step (measured: at most 3e-8).

In the same group: each DDP wrapper built with torch's DistributedDataParallel keywords, trained as
above; an unused parameter under ``find_unused_parameters=False`` (refused at the next forward, as
torch's DDP refuses it) and ``True`` (trained); torch's keywords ours refuse, in one line each; and
torch's ``FSDPModule`` methods called on our ``fully_shard``'s modules and on torch's, whose weights
must agree every step.
"""

from __future__ import annotations

import pytest

from tests.rank_pool import on_pool
from tests.practitioner_cases import (DDP_SIDES, DDP_WRAPPERS, FSDP_SIDES, REFUSED_KEYWORDS, run_practitioner_sides,
                                      train_one_process)

pytestmark = [pytest.mark.problem("beyond"), pytest.mark.timeout(300)]

ATOL = 1e-6
SIDES = ([f"fsdp-{s}" for s in FSDP_SIDES] + [f"ddp-{s}" for s in DDP_SIDES]
         + [f"ddp-{s}-torch-keywords" for s in DDP_SIDES])
_runs: dict[str, list[dict]] = {}


def _ranks() -> list[dict]:
    if "ranks" not in _runs:
        _runs["ranks"] = on_pool(run_practitioner_sides, 2, timeout_s=120)
    return _runs["ranks"]


@pytest.mark.xdist_group("practitioner")
@pytest.mark.parametrize("side", SIDES)
def test_script_trains_as_one_process(side: str):
    expected = train_one_process()
    for rank, result in enumerate(_ranks()):
        seen = result[side]
        where = f"{side}, rank {rank}"
        assert seen["decayed"] == expected["decayed"], where
        assert seen["numel"] == expected["numel"], where
        assert seen["norms"] == pytest.approx(expected["norms"], rel=1e-5), where
        for step, (got, want) in enumerate(zip(seen["history"], expected["history"])):
            assert got.keys() == want.keys(), where
            worst = max((got[n] - want[n]).abs().max().item() for n in want)
            assert worst <= ATOL * (step + 1), f"{where}, step {step}: {worst:.2e}"


def test_clipping_is_active():
    """The comparison can fail: every step's gradient norm is above the clipping threshold, so
    a side that clipped by its own shard's norm would take other steps."""
    from tests.practitioner_cases import MAX_NORM

    assert min(train_one_process()["norms"]) > 2 * MAX_NORM


@pytest.mark.xdist_group("practitioner")
@pytest.mark.parametrize("side", DDP_SIDES)
def test_an_unused_parameter_is_refused_as_torch_refuses_it(side: str):
    """With ``find_unused_parameters=False`` (torch's keyword), a parameter no rank used stops the
    run at the next forward on every rank, as torch's DDP does, and ours names it; with True,
    both train on."""
    for rank, result in enumerate(_ranks()):
        strict, tolerant = result["unused"][(side, False)], result["unused"][(side, True)]
        assert "find_unused_parameters" in strict, (side, rank, strict)
        if side != "torch":  # torch names indices unless TORCH_DISTRIBUTED_DEBUG is set
            assert "spare.weight, spare.bias" in strict, strict
        assert tolerant == "trained", (side, rank, tolerant)


@pytest.mark.xdist_group("practitioner")
def test_fsdp_module_methods_train_to_torchs_weights():
    """torch's FSDPModule methods (unshard, reshard, prefetch lists, reshard after forward and
    backward, last backward, gradient sync) called on our fully_shard's modules as on torch's:
    the same weights after every step (float32 rounding of another summation order: ATOL)."""
    for rank, result in enumerate(_ranks()):
        ours, theirs = result["fsdp-methods"]["ours"], result["fsdp-methods"]["torch"]
        assert len(ours) == len(theirs) > 0
        for step, (got, want) in enumerate(zip(ours, theirs)):
            assert got.keys() == want.keys()
            worst = max((got[n] - want[n]).abs().max().item() for n in want)
            assert worst <= ATOL * (step + 1), f"rank {rank}, step {step}: {worst:.2e}"


@pytest.mark.xdist_group("practitioner")
@pytest.mark.parametrize("side", DDP_WRAPPERS)
def test_torch_keywords_ours_cannot_honour_are_refused_in_one_line(side: str):
    """Each refusal names the keyword and its value, on one line; bucket_cap_mb is refused only
    by the wrappers without buckets, which name the one that has them."""
    said = _ranks()[0]["refusals"][side]
    expected = [words for _, words in REFUSED_KEYWORDS]
    if side not in ("bucketed", "auto"):
        expected.append("has no buckets, so it takes no bucket_cap_mb=10: BucketedDDP does")
    assert len(said) == len(expected)
    for (kind, message), words in zip(said, expected):
        assert kind in ("TypeError", "ValueError") and words in message and "\n" not in message, (kind, message)
