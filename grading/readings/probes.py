"""What the suite observes inside a rank beyond the values a submission computes.

* ``CollectiveLog`` wraps torch.distributed's collectives (installed before the submission is
  imported, so ``from torch.distributed import all_reduce`` gets the wrapped one too) and records
  each call: whether backward was still running when it was issued, the bytes it carried, and,
  for a reduction, whether it was asynchronous (``async_op=True``) and left pending until
  backward had finished. A 1-element all-reduce carries 4 bytes, not a gradient.
* ``BackwardProbe`` is an identity layer whose backward marks the moment the gradients of every
  layer above it are done and only the layers below remain: a collective logged before that
  moment overlapped backward.
* ``held_tensors`` lists the tensor storages an object holds, however it nests them, each with
  the path to it: a hint a memory finding shows a TA, never a basis of points (memory is read
  from outside the rank: grading/readings/outside.py).
"""

from __future__ import annotations

import array
import gc
import hashlib
import mmap
import types
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_reduce_coalesced",
              "_reduce_scatter_base")
OTHERS = ("broadcast", "all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object",
          "broadcast_object_list", "scatter", "gather", "all_to_all", "all_to_all_single")


@dataclass
class Call:
    """One collective a rank issued."""

    name: str
    during_backward: bool  # issued before the probe's backward: layers below it still had work
    nbytes: int  # the payload: the largest tensor argument (a list of tensors counts whole)
    is_async: bool = False  # async_op=True: it returned a work handle
    # its handle was waited on while layers still had gradients to compute (before the probe's
    # backward): a wait at the very end of backward, as torch's DDP makes in its final callback,
    # comes after every later layer's work and is not one
    waited_in_backward: bool = False
    dtype: str = ""  # the payload's dtype ("bfloat16"): what a gather carried, as the rank's own record says

    @property
    def reduction(self) -> bool:
        return self.name in REDUCTIONS

    @property
    def overlapping(self) -> bool:
        """Left to run while backward went on: asynchronous, and not waited on before the layers
        below the probe had their turn."""
        return self.is_async and not self.waited_in_backward


@dataclass
class CollectiveLog:
    calls: list[Call] = field(default_factory=list)
    in_backward: bool = False  # from loss.backward() until the probe's backward
    backward_running: bool = False  # from loss.backward() until it returns
    paused: bool = False  # the suite's own collectives are not the submission's
    at_probe: object = None  # called (no arguments) when backward reaches the probe: the traffic run's hold
    # the work handles of the collectives issued since, while a traffic run's gate (training._Gate)
    # watches them until the probe; None otherwise (a handle keeps its tensors alive)
    pending: list | None = None

    def reductions(self, since: int = 0) -> list[Call]:
        return [c for c in self.calls[since:] if c.reduction]


LOG = CollectiveLog()


def payload(args: tuple, kwargs: dict) -> tuple[int, str]:
    """The bytes a collective carries: its largest tensor argument, a list of tensors summed
    (reduce_scatter's inputs; the output of reduce_scatter_tensor is smaller than its input);
    and that argument's dtype."""
    sizes = [(0, "")]
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            sizes.append((value.numel() * value.element_size(), _dtype(value)))
        elif isinstance(value, (list, tuple)):
            tensors = [t for t in value if isinstance(t, torch.Tensor)]
            sizes.append((sum(t.numel() * t.element_size() for t in tensors), _dtype(tensors[0]) if tensors else ""))
    return max(sizes, key=lambda s: s[0])


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class TrackedWork:
    """A collective's work handle, passed through, that notes a wait while backward still had
    layers to compute (before the probe's backward)."""

    def __init__(self, work, call: Call):
        self._work, self._call = work, call

    def wait(self, *args, **kwargs):
        if LOG.in_backward:
            self._call.waited_in_backward = True
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _wrapped(name: str, original):
    def collective(*args, **kwargs):
        if LOG.paused:
            return original(*args, **kwargs)
        nbytes, dtype = payload(args, kwargs)
        call = Call(name, LOG.in_backward, nbytes, dtype=dtype)
        LOG.calls.append(call)
        work = original(*args, **kwargs)
        if work is not None and hasattr(work, "wait"):
            call.is_async = True
            if LOG.pending is not None:
                LOG.pending.append(work)
            return TrackedWork(work, call)
        return work

    collective.__wrapped__ = original
    collective.__name__ = name
    collective.grading_logged = True
    return collective


def install_collective_log() -> None:
    """Wrap every collective of torch.distributed (and of distributed_c10d, where it lives)."""
    from torch.distributed import distributed_c10d

    for name in REDUCTIONS + OTHERS:
        for namespace in (dist, distributed_c10d):
            original = getattr(namespace, name, None)
            if original is not None and not getattr(original, "grading_logged", False):
                setattr(namespace, name, _wrapped(name, original))


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        LOG.in_backward = False  # every layer above the probe is done; the ones below remain
        if LOG.at_probe is not None:
            LOG.at_probe()
        return grad


class BackwardProbe(torch.nn.Module):
    """Identity; backward is "running" from the loss until this layer's backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Probe.apply(x)


class backward_running:
    """``with backward_running(): loss.backward()``: marks the whole of backward, and its first
    part (until the probe's backward) as the part other layers' work can overlap."""

    def __enter__(self):
        LOG.in_backward = LOG.backward_running = True

    def __exit__(self, *exc):
        LOG.in_backward = LOG.backward_running = False


@dataclass(frozen=True)
class Holder:
    """One tensor storage an object keeps alive, and the shortest way to it from that object."""

    path: str  # e.g. ``fsdp.module.up.full_copy`` or ``optimizer.state[<Parameter 32×32>]['exp_avg']``
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    digest: str = ""  # of its bytes, where asked (held_tensors' ``digests``): a buffer that changes is in use

    def line(self) -> str:
        shape = "×".join(map(str, self.shape)) or "scalar"
        kind = "tensor" if self.dtype != "buffer" else "buffer"
        return f"{self.path} → {kind} {shape} {self.dtype if kind == 'tensor' else 'bytes'} ({self.nbytes} bytes)"


BUFFERS = (bytearray, memoryview, array.array, mmap.mmap)  # memory a rank can keep bytes in besides tensors


def held_tensors(root: object, name: str, exclude: set[int] = frozenset(), classes_of: frozenset[str] = frozenset(),
                 digests: int | None = None) -> list[Holder]:
    """Every distinct tensor storage and byte buffer (``BUFFERS``, numpy arrays) reachable from
    ``root`` (largest first), except storages whose data pointer is in ``exclude``, each with the
    shortest path to it (breadth first). Follows containers (dict keys too), instance attributes
    and slots, modules' parameter, buffer, hook and submodule tables, tensor attributes, bound
    methods and closures, and the attributes of classes defined in the modules ``classes_of``
    names (a class attribute is a place to keep state); not modules or other classes.
    ``digests``: each holder of at least that many bytes gets a digest of its bytes."""
    return sorted(_walk(root, name, exclude, classes_of, digests).values(), key=lambda h: -h.nbytes)


def _digest(data) -> str:
    return hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).hexdigest()


def _walk(root: object, name: str, exclude: set[int], classes_of: frozenset[str] = frozenset(),
          digests: int | None = None) -> dict[int, Holder]:
    seen: set[int] = set()
    found: dict[int, Holder] = {}
    queue: deque[tuple[object, str]] = deque([(root, name)])
    skip = (types.ModuleType, type, types.BuiltinFunctionType, str, bytes, int, float, bool, types.FrameType)
    while queue and len(seen) < 500_000:
        obj, path = queue.popleft()
        if obj is None or id(obj) in seen:
            continue
        if isinstance(obj, type) and getattr(obj, "__module__", None) in classes_of:
            seen.add(id(obj))
            queue.extend((v, f"{path}.{k}") for k, v in list(vars(obj).items()) if not k.startswith("__"))
            continue
        if isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, BUFFERS) or type(obj).__name__ == "ndarray":
            try:
                nbytes = memoryview(obj).nbytes
            except (TypeError, ValueError):
                continue
            digest = _digest(obj) if digests is not None and nbytes >= digests else ""
            found.setdefault(id(obj), Holder(path, (nbytes,), "buffer", nbytes, digest))
            continue
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                storage = obj.untyped_storage()
                if storage.data_ptr() not in exclude and storage.data_ptr() not in found:
                    digest = ""
                    if digests is not None and storage.nbytes() >= digests and obj.device.type == "cpu":
                        digest = _digest(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())
                    found[storage.data_ptr()] = Holder(path, tuple(obj.shape), str(obj.dtype).removeprefix("torch."),
                                                       storage.nbytes(), digest)
            queue.extend((v, f"{path}.{k}") for k, v in getattr(obj, "__dict__", {}).items())
            continue
        if isinstance(obj, types.FunctionType):
            cells = zip(obj.__code__.co_freevars, obj.__closure__ or ())
            queue.extend((c.cell_contents, f"{path}.<{var}>") for var, c in cells if _filled(c))
        elif isinstance(obj, types.MethodType):
            queue.append((obj.__self__, path))
        elif isinstance(obj, dict):
            for k, v in list(obj.items()):
                queue.append((v, f"{path}[{_label(k)}]"))
                queue.append((k, f"{path} key {_label(k)}"))
        elif isinstance(obj, (list, tuple)):
            queue.extend((v, f"{path}[{i}]") for i, v in enumerate(obj))
        elif isinstance(obj, (set, frozenset)):
            queue.extend((v, f"{path}{{…}}") for v in obj)
        elif isinstance(obj, torch.nn.Module):  # by the names a reader knows: fsdp.module.up.weight
            tables = ("_modules", "_parameters", "_buffers")
            queue.extend((v, f"{path}.{k}") for t in tables for k, v in getattr(obj, t, {}).items())
            queue.extend((v, f"{path}.{k}") for k, v in vars(obj).items() if k not in tables)
        else:
            named = dict(getattr(obj, "__dict__", {}))
            for slot in getattr(type(obj), "__slots__", ()):
                if isinstance(slot, str) and hasattr(obj, slot):
                    named[slot] = getattr(obj, slot)
            queue.extend((v, f"{path}.{k}") for k, v in named.items())
            known = {id(v) for v in named.values()} | {id(getattr(obj, "__dict__", None))}
            queue.extend((r, f"{path}.<ref>") for r in gc.get_referents(obj) if id(r) not in known)
    return found


def _label(key: object) -> str:
    if isinstance(key, torch.Tensor):
        return f"<{type(key).__name__} {'×'.join(map(str, key.shape))}>"
    if isinstance(key, (str, int, float, bool)):
        return repr(key)
    return f"<{type(key).__name__}>"


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True

