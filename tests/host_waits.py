"""Counting, without a GPU, the places where a training step would make the host wait for the device.

On a GPU the host queues kernels and runs ahead; it waits only when it needs a value that lives
in device memory (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``) or copies between host
and device with a blocking copy (``torch.tensor(data, device=...)`` is one). Each such wait
drains the queue: backward's communication stops overlapping and the next kernels start late.

The step is run on the ``meta`` device (shapes only, nothing computed) under a
:class:`HostWaitCounter` dispatch mode, which sees every operator and records those waits with
the line of our code that asked for them. A meta tensor holds no value, so a read is answered
with the host data it was copied from, if it was (an order broadcast from rank 0), else with a
stand-in (1 for floats, True, the world size for integers): enough for the wrapper's control
flow to go on, and the count is what the tests assert. The process group is torch's
``fake`` backend: collectives return at once, every rank's data is this rank's.
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
REPO = Path(__file__).resolve().parents[1]


def _our_caller() -> str:
    """``path:line`` of the innermost frame in this repo's library code."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if REPO / "cs336_systems" in path.parents:
            return f"{path.relative_to(REPO)}:{frame.lineno}"
    return "outside cs336_systems"


class _HostDataOnDevice:
    """``torch.tensor(data, device=d)`` copies host data below the dispatcher: while entered,
    ``torch.tensor`` and ``torch.as_tensor`` route it through an explicit copy so that the
    dispatch mode sees it. They are replaced rather than intercepted by a TorchFunctionMode
    because autograd turns function modes off inside backward, where gradient hooks and the
    reduction queued to run when backward ends (``queue_callback``) do their work."""

    def __enter__(self):
        self._originals = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}
        for name, original in self._originals.items():
            setattr(torch, name, self._routed(original))
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch, name, original)
        return False

    @staticmethod
    def _routed(func):
        def routed(*args, **kwargs):
            if kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "cpu":
                return func(*args, **{**kwargs, "device": "cpu"}).to(torch.device(kwargs["device"]))
            return func(*args, **kwargs)

        return routed


class HostWaitCounter(TorchDispatchMode):
    """Records host-device waits on ``device`` ("meta") by the line of our code that caused them."""

    def __init__(self, world_size: int, device: str = "meta"):
        super().__init__()
        self.device = device
        self.world_size = world_size
        self.waits: Counter[str] = Counter()
        self.collectives = 0
        self._host_data = _HostDataOnDevice()
        self._copied_from_host = WeakIdKeyDictionary()

    def __enter__(self):
        self._host_data.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._host_data.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.waits.values())

    def _stand_in(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        if t in self._copied_from_host:
            return self._copied_from_host[t].to(dtype or t.dtype)
        dtype = dtype or t.dtype
        fill = True if dtype == torch.bool else 1.0 if dtype.is_floating_point else self.world_size
        return torch.full(t.shape, fill, dtype=dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            self.collectives += 1
        on_device = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == self.device]
        if func is aten._local_scalar_dense.default and on_device:
            self.waits[_our_caller()] += 1
            return self._stand_in(args[0]).item()
        if func is aten._to_copy.default:
            source = args[0].device.type
            target = torch.device(kwargs.get("device") or args[0].device).type
            blocking = not kwargs.get("non_blocking", False)
            if {source, target} == {self.device, "cpu"} and blocking:
                self.waits[_our_caller()] += 1
            if (source, target) == (self.device, "cpu"):
                return self._stand_in(args[0], kwargs.get("dtype"))
            if (source, target) == ("cpu", self.device):
                out = func(*args, **kwargs)
                self._copied_from_host[out] = args[0].clone()
                return out
        if func is aten.copy_.default:
            target, source = args[0].device.type, args[1].device.type
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if {source, target} == {self.device, "cpu"} and blocking:
                self.waits[_our_caller()] += 1
            if (source, target) == (self.device, "cpu"):
                return args[0].copy_(self._stand_in(args[1]))
            if (source, target) == ("cpu", self.device):
                self._copied_from_host[args[0]] = args[1].clone()
        return func(*args, **kwargs)
