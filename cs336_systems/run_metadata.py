"""What every benchmark records beside its numbers: the machine, the software, the commit.

A results file is ``{"meta": ..., "records": [...]}``: ``meta`` from :func:`collect_environment`
says where and how the numbers were taken; ``records`` holds one dict per measured setting.
Files live in ``writeup/results/<machine tag>/<benchmark>.json`` so that runs on different
machines sit side by side instead of overwriting each other.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

# cs336_systems/ sits at the repository root (the package is installed editable).
REPO_ROOT = Path(__file__).resolve().parents[1]
MACHINE_TAG_ENV = "BENCH_MACHINE_TAG"
_CPU_SLUG_MAX_CHARS = 40


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


def collect_environment(backend: str, world_size: int, device_type: str) -> dict[str, Any]:
    """Everything needed to say what a measurement was taken on. Never raises for missing git."""
    commit, dirty = git_state()
    gpus = gpu_names()
    nccl_version = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl_version = ".".join(str(part) for part in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError, TypeError):
            pass
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python_version": sys.version.split()[0],
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda if torch.cuda.is_available() else None,
        "nccl_version": nccl_version,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu_name": gpus[0] if gpus else None,
        "gpu_count": len(gpus),
        "backend": backend,
        "world_size": world_size,
        "device_type": device_type,
        "machine_tag": machine_tag(),
        "git_commit": commit,
        "git_dirty": dirty,
        "timestamp_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def results_dir(tag: str | None = None) -> Path:
    """``<repo>/writeup/results/<tag>``; the tag defaults to :func:`machine_tag`."""
    return REPO_ROOT / "writeup" / "results" / (tag or machine_tag())


def write_results(path: str | os.PathLike, records: list[dict], meta: dict) -> Path:
    """Write ``{"meta": meta, "records": records}`` as stable, diff-friendly JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"meta": meta, "records": records}, indent=2, sort_keys=True)
    path.write_text(text + "\n")
    return path


def read_results(path: str | os.PathLike) -> dict[str, Any]:
    """The ``{"meta": ..., "records": [...]}`` dict that :func:`write_results` wrote."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "meta" not in data or "records" not in data:
        raise ValueError(f"{path} is not a results file: expected keys 'meta' and 'records'")
    return data
