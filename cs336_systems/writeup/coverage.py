"""Which settings the results cover, and the command that measures those they do not.

The writeup never fills a gap with a number: a setting with no results file is listed as
"not measured here" with the Make target that produces it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cs336_systems.writeup.analysis import is_measured
from cs336_systems.writeup.load import WriteupInputs


@dataclass(frozen=True)
class Setting:
    """A kind of run the handout asks about, and how to produce it."""

    name: str  # what a reader calls it
    backend: str
    device_type: str
    command: str  # the Make target that writes its results
    where: str  # what machine the command needs


CPU = Setting("gloo on CPU", "gloo", "cpu", "make bench", "on any machine")
GPU = Setting("NCCL on GPUs", "nccl", "cuda", "make bench-gpu", "on a node with 2–6 GPUs")
SETTINGS = (CPU, GPU)
# The profiler runs inside each suite (cs336_systems/bench_suites.py).
PROFILE_COMMANDS = {CPU: CPU.command, GPU: GPU.command}


def ddp_run_setting(meta: dict) -> tuple[str, str]:
    """(backend, device type) of a DDP step or profile run, from its meta."""
    setting = meta.get("setting") or {}
    device = setting.get("device_type") or meta.get("device_type") or "cpu"
    backend = meta.get("backend") or setting.get("backend") or ("nccl" if device == "cuda" else "gloo")
    return backend, device


def measured_settings(inputs: WriteupInputs, benchmark: str) -> set[tuple[str, str]]:
    """(backend, device type) pairs with at least one measured record of ``benchmark``."""
    if benchmark == "profile":
        return {ddp_run_setting(m.profile.meta) for m in inputs.machines if m.profile and m.profile.records}
    found: set[tuple[str, str]] = set()
    for _, results in inputs.runs(benchmark):
        if benchmark == "allreduce":
            found |= {(r["backend"], r.get("device_type", "cpu")) for r in results.records if is_measured(r)}
        elif results.records:
            found.add(ddp_run_setting(results.meta))
    return found


def not_measured_notes(inputs: WriteupInputs, benchmark: str, what: str) -> str:
    """Markdown bullets for each standard setting with no results of ``benchmark``; "" if none missing.

    ``benchmark`` is a results file stem ("allreduce", "ddp_step") or "profile".
    """
    found = measured_settings(inputs, benchmark)
    commands = PROFILE_COMMANDS if benchmark == "profile" else {s: s.command for s in SETTINGS}
    lines = [
        f"- {what}, {s.name} (`{s.backend}`): **not measured here**; `{commands[s]}` ({s.where}) fills it."
        for s in SETTINGS
        if (s.backend, s.device_type) not in found
    ]
    return "\n".join(lines)

