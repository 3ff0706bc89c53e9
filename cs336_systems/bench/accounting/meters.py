"""Reading a rank's memory: its peak since the last reset and its current level.

Two meters, one per device (each record's ``method`` names it):

* ``cuda_allocator`` (:class:`CudaAllocatorMeter`): ``torch.cuda.max_memory_allocated`` /
  ``memory_allocated``, the peak reset with ``reset_peak_memory_stats``: tensor bytes, exactly.
* ``rss`` (:class:`RssMeter`): on a CPU torch keeps no allocator statistics (``tracemalloc``
  sees only Python's own allocations, not torch's C++ ones), so we read the process's resident
  set size from ``/proc/self/status``: VmRSS now, VmHWM the peak. Since Linux 4.0 writing ``5``
  to ``/proc/self/clear_refs`` resets VmHWM to the current RSS (proc(5)), which gives per-phase
  peaks as on the GPU; ``peak_resettable`` says whether that worked.

RSS counts pages, not tensors. To make it follow tensor memory, glibc must give freed blocks
back: it normally raises its mmap threshold each time a mapped block is freed (up to 32 MiB on
64-bit, mallopt(3)), after which freed tensors stay resident and RSS stops falling when tensors
are freed. :func:`fix_malloc_mmap_threshold` fixes the threshold with ``mallopt`` (which turns
that adjustment off), so every block of 128 KiB or more is its own mapping, unmapped when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys

import torch

from cs336_systems.comm.timing import sync_device
from cs336_systems.units import KB

_PROC_STATUS = "/proc/self/status"
_PROC_CLEAR_REFS = "/proc/self/clear_refs"
# mallopt(3) parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MALLOC_MMAP_THRESHOLD_BYTES = 128 * KB  # glibc's default starting threshold, held fixed


def read_proc_status(text: str) -> dict[str, int]:
    """VmRSS and VmHWM, in bytes, from the text of /proc/<pid>/status (which gives kB = KiB)."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            number, unit = rest.split()
            if unit != "kB":
                raise ValueError(f"unexpected unit {unit!r} for {key} in /proc status")
            values[key] = int(number) * KB
    return values


def fix_malloc_mmap_threshold(threshold_bytes: int = MALLOC_MMAP_THRESHOLD_BYTES) -> int | None:
    """Make glibc map blocks of ``threshold_bytes`` or more on their own and unmap them on free.

    Returns the threshold, or None where there is no glibc ``mallopt`` (musl, macOS) or it
    refused. Also sets the trim threshold, so freed memory at the top of the heap goes back too.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return None
    # mallopt returns 1 on success, 0 on error.
    if mallopt(_M_MMAP_THRESHOLD, threshold_bytes) != 1 or mallopt(_M_TRIM_THRESHOLD, threshold_bytes) != 1:
        return None
    return threshold_bytes


class RssMeter:
    """The process's resident set size: VmRSS and its high-water mark VmHWM (Linux)."""

    method = "rss"

    def __init__(self) -> None:
        self.peak_resettable = self._try_reset()

    def _try_reset(self) -> bool:
        try:
            with open(_PROC_CLEAR_REFS, "w") as f:
                f.write("5")  # proc(5), clear_refs: 5 sets VmHWM to the current RSS (Linux >= 4.0)
            return True
        except OSError:
            return False

    def reset_peak(self) -> None:
        if self.peak_resettable:
            self._try_reset()

    def read(self) -> tuple[int, int | None]:
        """(peak bytes, current bytes); without /proc, the lifetime peak and no current level."""
        try:
            with open(_PROC_STATUS) as f:
                values = read_proc_status(f.read())
            return values["VmHWM"], values["VmRSS"]
        except OSError:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak * (1 if sys.platform == "darwin" else KB), None  # bytes on macOS, KiB on Linux


class CudaAllocatorMeter:
    """torch's CUDA caching allocator statistics: bytes of live tensors, exactly."""

    method = "cuda_allocator"
    peak_resettable = True

    def __init__(self, device: torch.device):
        self.device = device

    def reset_peak(self) -> None:
        sync_device(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> tuple[int, int | None]:
        sync_device(self.device)
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)


Meter = RssMeter | CudaAllocatorMeter


def meter_for(device: torch.device) -> Meter:
    """The meter of ``device``'s memory: the CUDA allocator's on a GPU, the process RSS on a CPU."""
    return CudaAllocatorMeter(device) if device.type == "cuda" else RssMeter()
