"""Which settings the results cover, and the command that measures those they do not.

The writeup never fills a gap with a number: a setting with no results file is listed as
"not measured here" with the Make target that produces it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from cs336_systems.writeup.context import RenderContext
from cs336_systems.writeup.load import ResultsFile, WriteupInputs


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


def run_setting(results: ResultsFile) -> set[tuple[str, str]]:
    """(backend, device type) pairs a results file measured (a grid may hold several backends)."""
    env = results.environment
    return {(backend, env.device_type) for backend in env.backend.split(",")}


def measured_settings(inputs: WriteupInputs, kind: str, runs: Iterable[ResultsFile] | None = None) -> set[tuple[str, str]]:
    """(backend, device type) pairs with at least one results file of ``kind`` (or of ``runs``,
    where a section reads only some runs of its kind)."""
    found: set[tuple[str, str]] = set()
    for results in (runs if runs is not None else [f for _, f in inputs.runs(kind)]):
        if results.records:
            found |= run_setting(results)
    return found


def note_gaps(ctx: RenderContext, benchmark: str, what: str, runs: Iterable[ResultsFile] | None = None) -> list[Setting]:
    """Record, for the machines page's one list, each standard setting with no results of ``benchmark``.

    Returns the missing settings, so a page can say in a clause that something was not measured
    and link to the list (``details/machines.md#not-measured-here``) instead of repeating it.
    """
    found = measured_settings(ctx.inputs, benchmark, runs)
    commands = PROFILE_COMMANDS if benchmark == "profile" else {s: s.command for s in SETTINGS}
    missing = [s for s in SETTINGS if (s.backend, s.device_type) not in found]
    for s in missing:
        ctx.not_measured(f"{s.name} (`{s.backend}`, {s.where})", what, commands[s])
    return missing
