"""Sharded optimizers graded where each rank's memory is its own cgroup's charge (grading/isolation/rank_cgroups.py).

* An unsharded optimizer that moves its whole state out of every process of the rank between
  steps and back for the next step: at world size 2 into files (rank 0 in its ``$HOME``, rank 1
  in ``/dev/shm``), at 3 into a helper each rank double-forks. The ranks' resident memory saw no
  state there; the cgroup counts the files' page cache and tmpfs pages and the helper, so the
  state is not sharded, at both world sizes.
* An "FSDP" that keeps every weight whole and averages gradients as DDP does, and moves all
  its weights into a file in ``/dev/shm`` after every optimizer step (a hook on every optimizer's
  step), bringing them back for forward and for the grader's gather: a rank's resident memory
  held none of them between steps; the cgroup counts the file, so weights are not sharded.
* A compact correct sharded optimizer (parameters dealt round-robin, each rank's own optimizer
  over its share, a broadcast from each owner): every point of the tests it is graded on.

Both are skipped where the grader can make no memory cgroup (share.describe says so in grade.md);
the second, a grading of its own, runs with ``FORGERIES=all`` (as the hostile matrix does), so
that ``make test`` stays within its time.
"""

from __future__ import annotations

import os
import uuid

import pytest

from grading.isolation import share
from grading.harness import grade
from grading.problems import named_for
from tests.test_grading import FSDP, QUICK, ZERO, failures, points
from tests.test_grading_probe_forgeries import forged

pytestmark = pytest.mark.problem("beyond")

STATE_MOVED_OUT = '''"""An unsharded optimizer whose state leaves every process of the rank between steps."""

import os
import socket
import struct

import torch
import torch.distributed as dist


def _exactly(sock, n):
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            os._exit(0)
        got += k
    return data


class _Helper:
    """A process that leaves the rank's tree (double fork, a session of its own) and keeps what it is sent."""

    def __init__(self):
        self.sock, theirs = socket.socketpair()
        child = os.fork()
        if child == 0:
            self.sock.close()
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            kept = {}
            while True:
                op, index, n = struct.unpack("<cQQ", _exactly(theirs, 17))
                if op == b"P":
                    kept[index] = _exactly(theirs, n)
                else:
                    data = kept.pop(index)
                    theirs.sendall(struct.pack("<Q", len(data)) + data)
        theirs.close()
        os.waitpid(child, 0)

    def put(self, index, data):
        self.sock.sendall(struct.pack("<cQQ", b"P", index, len(data)) + data)

    def get(self, index):
        self.sock.sendall(struct.pack("<cQQ", b"G", index, 0))
        (n,) = struct.unpack("<Q", _exactly(self.sock, 8))
        return _exactly(self.sock, n)


class _Files:
    def __init__(self, folder):
        self.folder = folder

    def _path(self, index):
        return os.path.join(self.folder, f".state-{os.getpid()}-{index}")

    def put(self, index, data):
        with open(self._path(index), "wb") as f:
            f.write(data)

    def get(self, index):
        with open(self._path(index), "rb") as f:
            data = bytearray(f.read())
        os.unlink(self._path(index))
        return data


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        self.inner, self.moved = None, []
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs
        super().__init__(params, kwargs)
        if dist.get_world_size() == 3:
            self.store = _Helper()
        else:
            self.store = _Files(os.environ["HOME"] if dist.get_rank() == 0 else "/dev/shm")

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = {**self.param_groups[-1]}
        if self.inner is None:
            self.inner = self.optimizer_cls([group], **self.kwargs)
        else:
            self.inner.add_param_group(group)

    def step(self, closure=None, **kwargs):
        for index, (state, key, shape, dtype) in enumerate(self.moved):
            state[key] = torch.frombuffer(self.store.get(index), dtype=dtype).view(shape)
        self.moved = []
        loss = self.inner.step(closure, **kwargs)
        for state in self.inner.state.values():
            for key, value in list(state.items()):
                if torch.is_tensor(value) and value.numel() > 1:
                    self.store.put(len(self.moved), value.detach().numpy().tobytes())
                    self.moved.append((state, key, value.shape, value.dtype))
                    state[key] = None
        return loss
'''

COMPACT = '''"""A compact sharded optimizer: parameters dealt round-robin over the ranks."""

import torch
import torch.distributed as dist


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        self.cls, self.kwargs, self.mine, self.owners = optimizer_cls, kwargs, None, []
        super().__init__(params, kwargs)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group, rank, size = self.param_groups[-1], dist.get_rank(), dist.get_world_size()
        start = len(self.owners)
        self.owners += [(p, (start + i) % size) for i, p in enumerate(group["params"])]
        shard = {**group, "params": [p for p, owner in self.owners[start:] if owner == rank]}
        if self.mine is None:
            self.mine = self.cls([shard], **self.kwargs)
        else:
            self.mine.add_param_group(shard)

    def step(self, closure=None, **kwargs):
        loss = self.mine.step(closure, **kwargs)
        for work in [dist.broadcast(p.data, src=owner, async_op=True) for p, owner in self.owners]:
            work.wait()
        return loss
'''


WEIGHTS_IN_SHM = '''"""Every weight whole, gradients averaged; between steps the weights live in a /dev/shm file."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook


class FSDP(nn.Module):
    def __init__(self, module, compute_dtype=None):
        super().__init__()
        self.module, self.away = module, {}
        register_optimizer_step_post_hook(lambda *args: self._move_out())

    def _path(self, name):
        return f"/dev/shm/.weights-{os.getpid()}-{name}"

    def _move_out(self):
        for name, p in self.module.named_parameters():
            with open(self._path(name), "wb") as f:
                f.write(p.detach().numpy().tobytes())
            self.away[name] = p.shape
            p.data = torch.empty(0)

    def _bring_back(self):
        for name, p in self.module.named_parameters():
            if name in self.away:
                with open(self._path(name), "rb") as f:
                    p.data = torch.frombuffer(bytearray(f.read()), dtype=torch.float32).view(self.away.pop(name))
                os.unlink(self._path(name))

    def forward(self, *args, **kwargs):
        self._bring_back()
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())

    def gather_full_params(self):
        self._bring_back()
        return {name: p.detach().clone() for name, p in self.module.named_parameters()}
'''


@pytest.fixture(scope="module")
def memory_cgroups():
    """Whether the harness can give each run a memory cgroup here (else these tests cannot tell)."""
    made = share.make(uuid.uuid4().hex)
    try:
        if made.memory is None:
            pytest.skip(f"no memory cgroup per rank here: {made.describe()}")
    finally:
        made.kill_all()
        made.remove()


def test_state_moved_out_between_steps_is_not_sharded(tmp_path, memory_cgroups):
    tree = forged(tmp_path, files={"cs336_systems/sharded_optimizer.py": STATE_MOVED_OUT})
    graded = grade(tree, tmp_path / "out", 1, "2026", QUICK, quiet=True, only=(ZERO,),
                   select="test_matches_single_process or test_state_is_sharded")
    assert [t.name for t in graded.tests if not t.passed] == [
        "test_sharded_optimizer.py::test_state_is_sharded[2]", "test_sharded_optimizer.py::test_state_is_sharded[3]"]
    for line in failures(graded, ZERO):
        assert f"the optimizer state is not sharded {named_for(ZERO)}" in line and "memory cgroup's charge" in line, line
        held = float(line.split(" holds ")[1].split(" MB")[0])
        assert held > 10.0, line  # the whole state (12 MB), wherever it went


@pytest.mark.skipif(os.environ.get("FORGERIES") != "all", reason="a grading of its own: FORGERIES=all runs it")
def test_compact_correct_variant_keeps_every_point(tmp_path, memory_cgroups):
    tree = forged(tmp_path, files={"cs336_systems/sharded_optimizer.py": COMPACT})
    graded = grade(tree, tmp_path / "out", 1, "2026", QUICK, quiet=True, only=(ZERO,),
                   select="test_matches_single_process or test_state_is_sharded or test_every_rank_keeps_its_share")
    assert [t.output for t in graded.tests if not t.passed] == []
    assert points(graded, ZERO) == pytest.approx(15.0, abs=2e-4)


@pytest.mark.skipif(os.environ.get("FORGERIES") != "all", reason="a grading of its own: FORGERIES=all runs it")
def test_fsdp_weights_moved_to_a_file_between_steps_are_not_sharded(tmp_path, memory_cgroups):
    tree = forged(tmp_path, files={"cs336_systems/fsdp.py": WEIGHTS_IN_SHM})
    graded = grade(tree, tmp_path / "out", 1, "2026", QUICK, quiet=True, only=(FSDP,),
                   select="test_matches_single_process or test_parameters_are_sharded")
    assert [t.name for t in graded.tests if not t.passed] == [
        "test_fsdp.py::test_parameters_are_sharded[2]", "test_fsdp.py::test_parameters_are_sharded[3]"], \
        failures(graded, FSDP)
    for line in failures(graded, FSDP):
        assert "weights are not sharded" in line and "memory cgroup's charge" in line, line
        assert float(line.split(" holds ")[1].split(" MB")[0]) > 24.0, line  # every weight, in the file
