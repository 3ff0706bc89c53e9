"""Where results live: ``writeup/results/<machine tag>/<kind>[-<suffix>].json``.

Every writer and reader asks here; nothing else builds a results path by hand. A kind may
have several files on one machine (``ddp_step.json``, ``ddp_step-nccl1.json``): they are its
runs. Folders named ``quick*`` hold smoke runs that the writeup skips.
"""

from __future__ import annotations

from pathlib import Path

from cs336_systems.results.environment import REPO_ROOT, machine_tag

RESULTS_ROOT = REPO_ROOT / "writeup" / "results"
SMOKE_PREFIX = "quick"  # results folders named quick* hold smoke runs, not results
NOT_QUIET_DIR = "not-quiet"  # a machine folder's subfolder for runs the host disturbed (results.files.save_results)
PROFILE_DIR = "profile"  # a machine folder's subfolder for the profiler's results and traces
# Kinds whose files live in a subfolder of the machine's folder, beside files of their own.
SUBFOLDER = {"profile": PROFILE_DIR}


def results_dir(tag: str | None = None, root: Path = RESULTS_ROOT) -> Path:
    """``<root>/<tag>``; the tag defaults to this machine's (see environment.machine_tag)."""
    tag = tag or machine_tag()
    if not tag or "/" in tag or tag in (".", ".."):
        raise ValueError(f"a results tag is one folder name, got {tag!r}")
    return root / tag


def results_path(kind: str, tag: str | None = None, suffix: str | None = None, root: Path = RESULTS_ROOT) -> Path:
    """The file of one run of ``kind``: ``<root>/<tag>/[<subfolder>/]<kind>[-<suffix>].json``."""
    name = kind if not suffix else f"{kind}-{suffix}"
    folder = results_dir(tag, root)
    return (folder / SUBFOLDER[kind] if kind in SUBFOLDER else folder) / f"{name}.json"
