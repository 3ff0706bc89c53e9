"""The doctor inside the user's own training: :class:`JobDoctor` watches a plain PyTorch loop,
``DoctorCallback`` (callback.py) a Lightning one, and :meth:`JobDoctor.report` says, per rank,
what a DDP debugging checklist asks.

Three lines add it to a training script (every rank)::

    from cs336_systems.doctor import JobDoctor
    doctor = JobDoctor(model, optimizer, loader)   # after wrapping the model in DDP
    ...                                            # the training loop, unchanged
    doctor.report()                                # after training: a collective; rank 0 prints

What it watches, through hooks only (the loop is not changed):

* the group: world size, backend, host and device of each rank;
* the data: the loader's sampler (a ``DistributedSampler`` of this group?), batches per epoch,
  the batches and the samples of each batch each rank trained on (ranks training different
  numbers of samples per step), and whether the ranks' first batches coincide;
* the steps: optimizer steps per rank (a rank that skipped ``optimizer.step()``);
* the replicas: checksums of every parameter after the first optimizer step and at the end,
  compared across the ranks that must hold the same values: every rank for a plain parameter;
  for a DTensor (FSDP2's shards) the local shard, compared across the ranks holding the same
  shard (HSDP's replicas; with plain sharding each shard has one holder, nothing to compare);
* the time: per step, from the batch's forward to the end of backward's own computation (before
  DDP's reduction, where a fast rank waits for a slow one: ``BackwardClock``), the time from an
  optimizer step to the next batch's start (what the rank waits for its data), and the time
  between optimizer steps; a rank whose fastest compute, or fastest wait for data, is well above
  the others' is a straggler.

:meth:`report` exchanges the observations through the job's key-value store with a deadline
(exchange.py), not a collective: a rank that never arrives (it is still inside an iteration
another rank skipped) is named with what it last did, and the report raises instead of hanging.

Cost: no collective; one small write to the store per batch and per optimizer step (the progress
a report quotes of a missing rank); the first batch and the parameters after the first step are
read once (a host-device wait each on a GPU), and every backward waits for the compute stream
once, to read the clock (``timed=False`` turns the clock off). A healthy job prints nothing;
each problem is one finding with one line of advice (job_findings.py).
"""

from __future__ import annotations

import socket
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, DistributedSampler

from cs336_systems.comm.timing import BackwardClock
from cs336_systems.doctor.findings import AFTER_FIRST_STEP, AFTER_TRAINING, ParameterChecksum
from cs336_systems.doctor.exchange import Progress, StoreExchange
from cs336_systems.doctor.job_findings import (DISTRIBUTED_SAMPLER, RankObservation, find_missing_at_report,
                                               job_findings)

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def replica_checksums(params: list[torch.Tensor]) -> list[ParameterChecksum]:
    """One :class:`ParameterChecksum` per tensor (bits summed as integers: exact, order-free); of
    a DTensor, its local part: no collective, so a report cannot pair with a late rank's."""
    out = []
    with torch.no_grad():
        for p in params:
            p = p.to_local() if isinstance(p, DTensor) else p
            bits = p.detach().contiguous().view(_INT_OF_SIZE[p.element_size()])
            values = p.detach().double()
            out.append(ParameterChecksum(int(bits.sum(dtype=torch.int64)), float(values.sum()),
                                         float((values * values).sum())))
    return out


def batch_checksum(batch: Any) -> int:
    """A checksum of every tensor's values in ``batch`` (copied to the host: once per job)."""
    crc = 0
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor):
            crc = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc


def shard_key(param: torch.Tensor) -> tuple:
    """Which ranks must hold the same values of ``param``: ``()`` for a plain tensor (every rank);
    for a DTensor (FSDP2's shards), its mesh and this rank's coordinates along the dimensions it
    is sharded over, so that ranks differing only along replicated ones (HSDP's replicas) match,
    and a shard no other rank holds is compared with nothing."""
    if not isinstance(param, DTensor):
        return ()
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate() or []
    sharded = tuple(c for c, placement in zip(coordinate, param.placements) if not placement.is_replicate())
    return (tuple(mesh.mesh.flatten().tolist()), sharded)


def batch_rows(batch: Any) -> int:
    """Rows of the batch: the first dimension of its first tensor."""
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return t.shape[0]
    return 0


class JobDoctor:
    """Watches one rank's training (see the module docstring); :meth:`report` gathers and judges.

    ``model``: what the loop calls (a DDP wrapper, or the module); ``optimizer``: one or a list;
    ``loader``: the training DataLoader, or None. The Lightning callback calls the ``on_*``
    methods itself and passes ``model=None``. ``report_timeout_s``: how long :meth:`report` waits
    for the other ranks before it reports the missing ones and raises :class:`DoctorTimeout`.
    """

    def __init__(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | list | None = None,
                 loader: DataLoader | None = None, *, timed: bool = True, straggler_factor: float = 1.5,
                 straggler_min_excess_s: float = 0.02, report_timeout_s: float = 30.0):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("JobDoctor needs the job's process group: create it (init_process_group, or "
                               "Lightning's strategy) before the doctor")
        if not straggler_factor > 1:
            raise ValueError(f"straggler_factor must be > 1, got {straggler_factor!r}")
        if not report_timeout_s > 0:
            raise ValueError(f"report_timeout_s must be > 0, got {report_timeout_s!r}")
        self.straggler_factor, self.straggler_min_excess_s = straggler_factor, straggler_min_excess_s
        self.report_timeout_s = report_timeout_s
        self.seen = RankObservation(dist.get_rank(), dist.get_world_size(), dist.get_backend(), socket.gethostname(),
                                    "cpu")
        self._exchange = StoreExchange(self.seen.rank, self.seen.world_size)
        self._params: list[tuple[str, torch.Tensor]] = []
        self._clock: BackwardClock | None = None
        self._timed = timed
        self._batch_start: float | None = None
        self._last_step: float | None = None
        self._handles: list[Any] = []
        if loader is not None:
            self.watch_loader(loader)
        if model is not None:
            self.watch_model(model)
            self._handles.append(model.register_forward_pre_hook(self._on_forward, with_kwargs=True))
            self._handles.append(model.register_forward_hook(self._on_output))
        for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer] if optimizer else []:
            self.watch_optimizer(opt)

    # -- what is watched -----------------------------------------------------------------------

    def watch_model(self, model: nn.Module) -> None:
        named = list(model.named_parameters())
        self._params = named
        self.seen.names = [n for n, _ in named]
        self.seen.shard_keys = [shard_key(p) for _, p in named]
        if named:
            self.seen.device = str(named[0][1].device)
            self._clock = BackwardClock(named[0][1].device) if self._timed else None

    def watch_loader(self, loader: DataLoader) -> None:
        sampler = getattr(loader, "sampler", None)
        self.seen.sampler = type(sampler).__name__
        if isinstance(sampler, DistributedSampler):
            self.seen.sampler = DISTRIBUTED_SAMPLER
            self.seen.sampler_replicas, self.seen.sampler_rank = sampler.num_replicas, sampler.rank
        try:
            self.seen.batches_per_epoch = len(loader)
        except TypeError:  # an iterable dataset: no length
            self.seen.batches_per_epoch = None

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._handles.append(optimizer.register_step_post_hook(lambda *_: self.on_optimizer_step()))

    # -- per batch -----------------------------------------------------------------------------

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled():
            self.on_batch((args, kwargs))

    def _on_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        if module.training and torch.is_grad_enabled():
            first = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if first is not None:
                self.on_loss(first)

    def on_batch(self, batch: Any) -> None:
        """A training batch starts."""
        now = time.perf_counter()
        if self.seen.batches == 0:
            self.seen.first_batch = batch_checksum(batch)
        elif self._last_step is not None:  # since the last step: loading this batch, mostly
            self.seen.data_wait_s.append(now - self._last_step)
        self.seen.batches += 1
        rows = batch_rows(batch)
        self.seen.rows.append(rows)
        self.seen.samples += rows
        self._batch_start = now
        self._note_progress(f"started batch {self.seen.batches}")

    def on_loss(self, loss: torch.Tensor) -> None:
        """A tensor whose backward starts this batch's (the model's output, or the loss)."""
        if self._clock is not None:
            self._clock.watch(loss)

    def on_optimizer_step(self) -> None:
        now = time.perf_counter()
        self.seen.optimizer_steps += 1
        if self._last_step is not None:
            self.seen.step_s.append(now - self._last_step)
        self._last_step = now
        clock = self._clock
        if clock is not None and clock.compute_end is not None and self._batch_start is not None:
            self.seen.compute_s.append(clock.compute_end - self._batch_start)
            clock.compute_end = None
        if self.seen.optimizer_steps == 1:
            self.seen.checksums[AFTER_FIRST_STEP] = replica_checksums([p for _, p in self._params])
        self._note_progress(f"took optimizer step {self.seen.optimizer_steps} after batch {self.seen.batches}")

    def _note_progress(self, doing: str) -> None:
        """One small write to the store: what the ranks that reach report() say of a missing one."""
        self._exchange.note_progress(Progress(self.seen.batches, self.seen.optimizer_steps, doing))

    # -- the report ----------------------------------------------------------------------------

    def report(self, print_findings: bool = True) -> list[str]:
        """Gather every rank's observations (every rank calls it) and return the findings, the
        same on every rank; rank 0 prints them with the per-rank table, and nothing on a healthy
        job. A rank that does not arrive within ``report_timeout_s`` is a finding of its own:
        the lowest rank that did arrive prints it, and every rank that did raises
        :class:`DoctorTimeout` with it, so the job ends instead of waiting (exchange.py)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.seen.checksums[AFTER_TRAINING] = replica_checksums([p for _, p in self._params])
        gathered, last = self._exchange.gather(self.seen, self.report_timeout_s)
        ranks = [r for r in gathered if r is not None]
        if last:
            findings = find_missing_at_report(ranks, last, self.report_timeout_s)
        else:
            findings = job_findings(ranks, self.straggler_factor, self.straggler_min_excess_s)
        if findings and print_findings and self.seen.rank == ranks[0].rank:
            from cs336_systems.doctor.format import format_job_report

            print(format_job_report(ranks, findings), flush=True)
        self.ranks = ranks
        if last:
            raise DoctorTimeout(" ".join(findings))
        return findings


class DoctorTimeout(RuntimeError):
    """Some ranks did not reach :meth:`JobDoctor.report` in time; the message says which, and
    what they last did."""
