"""fsdp (2026): Linear and Embedding weights sharded over ranks, gathered when used.

Beyond the public tests: world size 3 with shards that do not divide evenly, AdamW, every rank
checked at every step, and the bytes each rank keeps between steps, which must be about
1/world size of the full parameters (an FSDP that keeps every full weight fails).
"""

import pytest

from grading.cases import FSDPCase, assert_sharded, train_fsdp

pytestmark = pytest.mark.problem("fsdp")


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_single_process(ranks, world_size):
    ranks(train_fsdp, world_size, FSDPCase())


def test_adamw(ranks):
    ranks(train_fsdp, 2, FSDPCase(optimizer="adamw"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_parameters_are_sharded(ranks, world_size):
    assert_sharded(ranks(train_fsdp, world_size, FSDPCase()), "resident_bytes", "full_bytes",
                   "parameters between steps")
