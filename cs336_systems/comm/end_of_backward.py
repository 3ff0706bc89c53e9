"""Run a reduction when the current backward ends, as torch's DDP and ``fully_shard`` do.

autograd's engine runs the callbacks queued during a backward (``Variable._execution_engine
.queue_callback``) after that backward's last gradient is accumulated and before ``backward()``
returns, in the order they were queued, with the caller's streams current. DDP (ddp/base.py)
and FSDP (fsdp/schedule.py) queue their reduction from the first gradient hook of a backward;
:class:`AtEndOfBackward` queues it once per backward, however many hooks ask.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch


class AtEndOfBackward:
    """Calls ``method`` (a bound method, held weakly) once when the backward under way ends."""

    def __init__(self, method: Callable[[], None]):
        # Weakly: the object that owns this helper is kept alive by its users only, not by itself.
        self._method = weakref.WeakMethod(method)
        self.queued = False

    def queue(self) -> None:
        """Queue the call for the end of the current backward (once; later calls until then do nothing)."""
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        try:
            method = self._method()
            if method is not None:
                method()
        finally:
            self.queued = False
