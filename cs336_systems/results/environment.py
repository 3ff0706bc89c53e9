"""What every results file records beside its numbers: the machine, the software, the commit, the load, the host.

:func:`collect_environment` reads it once per run; :func:`machine_tag` names the machine's
results folder, so that runs on different machines sit side by side instead of overwriting
each other. :class:`Load` is the machine's load around the run: the load average when the
script started (read when this module is first imported, which every script does before it
runs anything) and when its results were written, the cores the run could use, and what other
jobs asked of the CPUs meanwhile (their runnable threads, counted each second outside the
script's own processes: ``results.others``; the load average counts the run's own threads
too). A run during which other jobs competed for the CPUs timed them as much as its own code,
and ``results.files.save_results`` refuses to file it under ``writeup/results/``. What the host
did meanwhile (CPU steal, a fixed calibration before and after, the spread of the compute-only
step) is :class:`~cs336_systems.results.host.Host`, watched from the same moment.
"""

from __future__ import annotations

import os
import time
import platform
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from cs336_systems.results import others
from cs336_systems.results.host import Host, HostWatch

# cs336_systems/ sits at the repository root (the package is installed editable).
REPO_ROOT = Path(__file__).resolve().parents[2]
MACHINE_TAG_ENV = "BENCH_MACHINE_TAG"
_CPU_SLUG_MAX_CHARS = 40


def _load_average() -> float:
    """The 1-minute load average (runnable and waiting processes, os.getloadavg); -1 where unknown."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return -1.0


def usable_cores() -> int:
    """Logical cores this process may run on (its CPU affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


_LOAD_AT_START = _load_average()  # when the script started: before any rank of the run existed
others.start_sampling()
# Steal counters and the calibration, from the start too; only where others' threads are sampled
# (a script's main process): a test process never spends the calibration's second.
HOST_WATCH = HostWatch() if others.sampling() else None
# Other jobs' runnable threads, on average over the run, from which on it shared the CPUs with
# them: half a core (a job that ran half the time on one core; the kernel's own threads and a
# shell's commands between samples stay far below it, about 0.05 on this 2-core machine).
OTHERS_LIMIT = 0.5
# Kinds held to a lower limit: the profile's two steps are read one event at a time (the overlap
# answer, the overhead model's B), so a tenth of a core's competition already moves them.
OTHERS_LIMIT_BY_KIND = {"profile": 0.25}


@dataclass(frozen=True)
class Load:
    """The machine's load around one run, against the cores the run used."""

    before: float  # 1-minute load average when the script started (-1: unknown)
    after: float  # 1-minute load average when its results were written
    cores: int  # logical cores the run could use (its CPU affinity)
    processes: int  # processes the run itself kept busy (its ranks on this machine)
    others: float | None = None  # other processes' runnable threads, averaged over the run (None: not sampled)
    others_limit: float = OTHERS_LIMIT  # the most of them the run's kind allows (OTHERS_LIMIT_BY_KIND)

    @property
    def limit(self) -> int:
        """The load the run accounts for by itself: its cores, or its own ranks where they
        outnumber the cores (a 6-rank grid on 2 cores oversubscribes them by design)."""
        return max(self.cores, self.processes)

    @property
    def exceeded(self) -> bool:
        """Other jobs were runnable beside the run: its times are not evidence. Where other jobs'
        threads were counted, they decide (with the load before the start, when none of the run's
        existed); else the load average, which counts the run's own threads as well."""
        if self.others is not None:
            return self.before > self.limit or self.others >= self.others_limit
        return max(self.before, self.after) > self.limit

    def why_busy(self) -> str:
        """Why :attr:`exceeded` holds, in words."""
        if self.others is not None and self.others >= self.others_limit:
            return f"other jobs' threads at {self.others:.2f}, not below the limit {self.others_limit}"
        return f"over {self.limit}, what this run's own processes account for"

    def describe(self) -> str:
        counted = "" if self.others is None else f", other jobs' runnable threads {self.others:.2f} on average"
        return f"load average {self.before:.1f} before and {self.after:.1f} after{counted}, on {self.cores} cores"


SETTLE_S = 150.0  # at most this long for the load average to forget the run before (it decays over a minute)


def settle_load(wait_s: float = SETTLE_S) -> float:
    """Wait until the 1-minute load average has fallen to this machine's usable cores, at most
    ``wait_s``; the load average then. A step of a suite started right after a heavy one (a
    6-rank all-reduce grid) found a load average of 7.3 left by processes that were gone, and its
    run was refused as "busy" with other jobs' threads at 0.00 (``Load.exceeded`` reads the load
    before the start as others'): the suite's runner waits for it between steps."""
    deadline = time.monotonic() + wait_s
    while _load_average() > usable_cores() - 0.5 and time.monotonic() < deadline:  # below, with a margin
        time.sleep(2.0)
    return _load_average()


def measure_load(processes: int) -> Load:
    """The load since this script started, for a run of ``processes`` busy processes."""
    mean = others.others_mean()
    return Load(round(_LOAD_AT_START, 2), round(_load_average(), 2), usable_cores(), processes,
                None if mean is None else round(mean, 3))


@dataclass(frozen=True)
class Environment:
    """Where and with what a measurement was taken."""

    hostname: str
    platform: str
    python_version: str
    torch_version: str
    cuda_version: str | None
    nccl_version: str | None
    cpu_model: str
    cpu_count: int | None
    gpu_name: str | None
    gpu_count: int
    backend: str  # the process group's backend ("gloo", "nccl"; "gloo,nccl" for a grid of both)
    world_size: int  # ranks of the job (the largest, for a grid of several)
    device_type: str  # "cpu" or "cuda"
    shared_gpu: bool  # several ranks of a node took turns on one GPU (gloo only)
    machine_tag: str
    git_commit: str | None  # None when run outside a git checkout
    git_dirty: bool | None  # uncommitted changes to code (not to writeup/) when measured
    timestamp_utc: str
    load: Load | None = None  # None in files written before the load was recorded
    host: Host | None = None  # steal, calibration, spread (results.host); None in files from before it


def slugify(text: str) -> str:
    """Lower case, runs of anything but letters and digits turned into one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def cpu_model() -> str:
    """The CPU's marketing name ("model name" in /proc/cpuinfo on Linux x86), or a fallback."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def gpu_names() -> list[str]:
    """Names of the visible CUDA devices (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _git(*args: str) -> str | None:
    """Output of a read-only git command in this repository, or None if git cannot answer."""
    try:
        done = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout


def git_state() -> tuple[str | None, bool | None]:
    """(commit of HEAD, whether the working tree has uncommitted changes); Nones without git."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return None, None
    # --no-optional-locks: a status query must not take .git/index.lock, which would make a
    # concurrent commit fail (git-status(1), "BACKGROUND REFRESH").
    # Generated artefacts under writeup/ (results files, figures) are outputs, not changes to
    # the code that measured them: a suite writing its first file must not mark the rest dirty.
    status = _git("--no-optional-locks", "status", "--porcelain", "--", ".", ":(exclude)writeup")
    return head.strip(), (None if status is None else bool(status.strip()))


def machine_tag() -> str:
    """A short, stable name for this machine's results folder.

    ``<count>x<gpu model>`` with GPUs (``2xnvidia-h100-80gb-hbm3``), else
    ``cpu<logical cores>-<cpu model>`` (``cpu2-intel-xeon-processor``). The environment
    variable BENCH_MACHINE_TAG overrides it, e.g. to file a cluster's nodes under one name.
    """
    override = os.environ.get(MACHINE_TAG_ENV, "").strip()
    if override:
        if "/" in override or override in (".", ".."):
            raise ValueError(f"{MACHINE_TAG_ENV} must be one folder name, got {override!r}")
        return override
    gpus = gpu_names()
    if gpus:
        return f"{len(gpus)}x{slugify(gpus[0])}"
    # "(R)" and "(TM)" carry no information and would eat into the length limit.
    model = slugify(re.sub(r"\((r|tm)\)", " ", cpu_model(), flags=re.IGNORECASE)) or "unknown"
    if len(model) > _CPU_SLUG_MAX_CHARS:
        model = model[:_CPU_SLUG_MAX_CHARS].rsplit("-", 1)[0]
    return f"cpu{os.cpu_count() or 1}-{model}"


def nccl_version() -> str | None:
    if not (torch.cuda.is_available() and hasattr(torch.cuda, "nccl")):
        return None
    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version())
    except (RuntimeError, AttributeError, TypeError):
        return None


def collect_environment(backend: str, world_size: int, device_type: str, shared_gpu: bool = False) -> Environment:
    """Everything needed to say what a measurement was taken on. Never raises for missing git."""
    commit, dirty = git_state()
    gpus = gpu_names()
    return Environment(
        hostname=socket.gethostname(),
        platform=platform.platform(),
        python_version=sys.version.split()[0],
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda if torch.cuda.is_available() else None,
        nccl_version=nccl_version(),
        cpu_model=cpu_model(),
        cpu_count=os.cpu_count(),
        gpu_name=gpus[0] if gpus else None,
        gpu_count=len(gpus),
        backend=backend,
        world_size=world_size,
        device_type=device_type,
        shared_gpu=shared_gpu,
        machine_tag=machine_tag(),
        git_commit=commit,
        git_dirty=dirty,
        timestamp_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        load=measure_load(world_size if device_type == "cpu" or shared_gpu else 1),
    )
