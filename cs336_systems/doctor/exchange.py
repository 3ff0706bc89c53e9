"""The in-job doctor's exchange: each rank's observations through the job's key-value store, with a
deadline, so that a report never waits forever for a rank that will not come.

A collective (``all_gather_object``) would pair with whatever collective a late rank is blocked in:
when one rank skipped an iteration, the others are still inside that iteration's all-reduce, and
the report's gather would wait for them until the process group's timeout (30 minutes by default),
or pair with the wrong call. The store (the rendezvous ``TCPStore`` every process group has) needs
no partner: each rank writes its observations under its own key and polls for the others' until
the deadline. A rank also writes a line of progress at each batch and optimizer step, so the ranks
that did arrive can say what a missing one last did.

Keys live under a prefix per doctor (``cs336-doctor/<n>/``): every rank creates its doctors in the
same order, so the n-th doctor of each rank shares one prefix.
"""

from __future__ import annotations

import itertools
import pickle
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

POLL_S = 0.05  # between looks at the store while ranks are missing
_doctors = itertools.count()  # doctors created by this process, in order


@dataclass(frozen=True)
class Progress:
    """What a rank last did, as it wrote it to the store."""

    batches: int  # batches started
    optimizer_steps: int
    doing: str  # e.g. "started batch 3"


class StoreExchange:
    """One doctor's keys in the default group's store (see the module docstring)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.store = dist.PrefixStore(f"cs336-doctor/{next(_doctors)}/", dist.distributed_c10d._get_default_store())
        self.rounds = 0  # gathers so far: each has keys of its own, so a second report reads fresh values

    def note_progress(self, progress: Progress) -> None:
        self.store.set(f"progress/{self.rank}", pickle.dumps(progress))

    def gather(self, mine: Any, timeout_s: float) -> tuple[list[Any | None], dict[int, Progress | None]]:
        """Every rank's ``mine`` (None for a rank that did not post within ``timeout_s``), and for
        each missing rank its last progress (None: it never wrote any)."""
        self.rounds += 1
        seen, read = f"seen{self.rounds}", f"read{self.rounds}"
        self.store.set(f"{seen}/{self.rank}", pickle.dumps(mine))
        missing = self._wait_for(seen, timeout_s)
        values = [None if r in missing else pickle.loads(self.store.get(f"{seen}/{r}")) for r in range(self.world_size)]
        last = {r: self._progress(r) for r in missing}
        if not missing:
            # Whoever hosts the store (rank 0) must outlive every rank's reads: wait until all read.
            self.store.set(f"{read}/{self.rank}", b"1")
            self._wait_for(read, timeout_s)
        return values, last

    def _wait_for(self, kind: str, timeout_s: float) -> set[int]:
        """Poll until every rank's ``kind`` key exists or the deadline; the ranks still missing."""
        deadline = time.monotonic() + timeout_s
        missing = set(range(self.world_size))
        while True:
            missing = {r for r in missing if not self.store.check([f"{kind}/{r}"])}
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(POLL_S)

    def _progress(self, rank: int) -> Progress | None:
        key = f"progress/{rank}"
        return pickle.loads(self.store.get(key)) if self.store.check([key]) else None
