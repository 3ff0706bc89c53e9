"""A process group's lifetime and a rank's exit: why finished gloo ranks aborted, and what prevents it.

A rank that had finished its work sometimes died at interpreter exit with ``terminate called
without an active exception`` (SIGABRT), so ``torch.multiprocessing.spawn`` raised although
every step had passed (issue 27; torch 2.13 and 2.15, torch's DDP and ours). A core dump of
such a rank shows the chain:

1. gloo runs collectives on two worker threads (``ProcessGroupGloo::runLoop``). A worker wakes
   the waiting rank when a collective completes and drops its own reference to the work a
   moment later. When the rank has already let go of its ``Work`` handle, that drop destroys
   the work and its tensors, and a tensor that has a Python object needs the GIL to release it.
2. gloo has no ``shutdown()``: ``destroy_process_group()`` only drops references, and the
   workers are joined when the last reference to the group goes. Something else holds one:
   ``torch.distributed.nn.functional`` takes ``group=group.WORLD`` as a default argument,
   evaluated when that module is first imported, and torch imports it lazily (the first
   optimizer built imports ``torch._dynamo``, which imports it). Built after
   ``init_process_group``, as in every training script, that default pins the group, and its
   workers, until the interpreter is torn down.
3. If a worker still has a finished work to drop once the main thread has begun finalizing
   (a loaded machine deschedules it for a moment), taking the GIL ends the thread with a
   forced unwind through a ``noexcept`` destructor: ``std::terminate``.

Importing this module first (``cs336_systems.launch``, the adapters and ``tests/common.py`` do)
imports ``torch.distributed.nn`` before any process group exists, so its defaults are ``None``;
then ``destroy_process_group()`` frees the group as soon as no wrapper holds it, and its
workers are joined (with the GIL released) while Python is fully alive. Imported too late, it
unpins the group instead, as ``teardown()`` does after destroying it (:func:`unpin_default_group`),
for a process where something imported torch's module between the two. The wrappers' own
``release()`` drops what they hold of a group. :func:`exit_rank` is the last guard of the ranks
this repository spawns itself: their results are written and closed by then, so they skip
interpreter finalization, whatever a user's function left behind.
"""

from __future__ import annotations

import os
import sys
import types
from typing import NoReturn

import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before any process group: see step 2 above)

# The thread name gloo gives its collective workers (``c10::setThreadName`` in runLoop).
GLOO_WORKER_THREAD = "pt_gloo_runloop"


def unpin_default_group() -> None:
    """Make ``torch.distributed.nn.functional``'s ``group`` defaults ``None`` again where its
    import, after ``init_process_group``, captured the default group in them.

    ``None`` means the default group at call time, which is what the captured one was meant to
    be, so calls behave the same; the difference is that a destroyed group can be freed.
    Run at this module's import, and by ``teardown()`` after destroying the group.
    """
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is None:
        return
    for fn in vars(functional).values():
        defaults = fn.__defaults__ if isinstance(fn, types.FunctionType) else None
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


unpin_default_group()  # in case this module itself was imported after init_process_group


def gloo_workers_alive() -> int:
    """How many gloo collective worker threads this process has (Linux; 0 elsewhere).

    0 after ``destroy_process_group()`` means the group was freed and its workers joined; a
    nonzero count means something still holds the group, and it will be torn down, with
    whatever its workers are doing, during interpreter finalization.
    """
    task_dir = "/proc/self/task"
    if not os.path.isdir(task_dir):
        return 0
    count = 0
    for tid in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, tid, "comm")) as f:
                count += f.read().strip() == GLOO_WORKER_THREAD
        except OSError:  # the thread ended while we listed them
            continue
    return count


def exit_rank(status: int) -> NoReturn:
    """End this rank process now with ``status``, skipping interpreter finalization.

    Call it only once everything the rank produced is written and closed: atexit handlers and
    unflushed file objects other than stdout and stderr are skipped.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, or replaced by something odd
            pass
    os._exit(status)
