"""Turning numbers from results files into text: significant digits, ratios, tables, settings.

Every number in the writeup passes through here, so one place decides how it looks. Times are
shown in milliseconds (or microseconds), bandwidths in GB/s (1e9 bytes/s, nccl-tests' unit),
sizes in MB (2**20 bytes, as everywhere in this repo).
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Callable, Iterable, Sequence

from cs336_systems.results.environment import Environment
from cs336_systems.units import GB, MB

GB_PER_S = 1e9  # nccl-tests' GB/s
SCIENTIFIC_BELOW, SCIENTIFIC_FROM = 1e-4, 1e7  # outside this range, plain notation gets unreadable


def sig(value: float | None, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits: "12.3", "0.00925", "1234", or "1.49e-08".

    Trailing zeros are kept: they are significant. Plain notation between 1e-4 and 1e7 (integer
    parts longer than the digits are kept whole), scientific notation outside.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if math.isinf(value):
        return "∞" if value > 0 else "−∞"
    if value == 0:
        return "0"
    if not SCIENTIFIC_BELOW <= abs(value) < SCIENTIFIC_FROM:
        return f"{value:.{digits - 1}e}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    # Rounding can carry into a new digit (9.996 -> "10.00"); redo with one decimal fewer.
    if decimals > 0 and len(text.lstrip("-").replace(".", "").lstrip("0")) > digits:
        text = f"{value:.{decimals - 1}f}"
    return text


def _in_unit(convert: Callable[[float], float], unit: str) -> Callable[[float | None, int], str]:
    """A formatter that shows a value converted into ``unit`` to ``digits`` significant digits."""
    def show(value: float | None, digits: int = 3) -> str:
        return sig(None if value is None else convert(value), digits)
    show.__doc__ = f"``value`` shown in {unit}."
    return show


ms = _in_unit(lambda seconds: seconds * 1e3, "milliseconds (from seconds)")
us = _in_unit(lambda seconds: seconds * 1e6, "microseconds (from seconds)")
gbps = _in_unit(lambda bytes_per_s: bytes_per_s / GB_PER_S, "GB/s (from bytes per second)")
mb = _in_unit(lambda n_bytes: n_bytes / MB, "MB, 2**20 bytes (from bytes)")
gb = _in_unit(lambda n_bytes: n_bytes / GB, "GB, 2**30 bytes (from bytes)")


def ms_interval(interval_s: Sequence[float] | None) -> str:
    """A (low, high) interval in seconds shown in milliseconds; "–" when there is none."""
    return "–" if not interval_s else f"{ms(interval_s[0])} to {ms(interval_s[1])}"


def ratio_interval(interval: Sequence[float] | None) -> str:
    """A ratio's (low, high) 95% interval as "[0.71, 0.84]"; "–" when there is none (too few rounds)."""
    return "–" if not interval else f"[{interval[0]:.2f}, {interval[1]:.2f}]"


def size_mb(value_mb: float) -> str:
    """A nominal size in MB (a payload or bucket size someone asked for): no trailing zeros."""
    text = sig(value_mb, 3)
    return text.rstrip("0").rstrip(".") if "." in text else text


def pct(fraction: float | None, digits: int = 3) -> str:
    """A fraction shown in percent."""
    return "–" if fraction is None else f"{sig(fraction * 100, digits)}%"


def ratio(value: float) -> str:
    """A ratio such as "1.63×"."""
    return f"{sig(value, 3)}×"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` has one letter per column, "l" or "r" (default: all "r"
    but the first)."""
    headers = list(headers)
    align = align or "l" + "r" * (len(headers) - 1)
    if len(align) != len(headers):
        raise ValueError(f"align has {len(align)} letters for {len(headers)} columns")
    rule = ["---:" if a == "r" else ":---" for a in align]
    lines = [_row(headers), _row(rule)]
    for row in rows:
        row = list(row)
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells for {len(headers)} columns: {row}")
        lines.append(_row(str(cell) for cell in row))
    return "\n".join(lines)


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def hardware(env: Environment, device_type: str | None = None) -> str:
    """What the numbers ran on: the GPU for CUDA runs, else the CPU and its logical cores."""
    device_type = device_type or env.device_type
    if device_type == "cuda" and env.gpu_name:
        return f"{env.gpu_count}× {env.gpu_name}" if env.gpu_count else env.gpu_name
    cpu = env.cpu_model or "unknown CPU"
    return f"{cpu} ({env.cpu_count} logical cores)" if env.cpu_count else cpu


def commit(env: Environment) -> str:
    """Short commit hash, flagged when the working tree had uncommitted changes."""
    if not env.git_commit:
        return "commit unknown (not run from a git checkout)"
    return f"commit {env.git_commit[:7]}" + (" + uncommitted changes" if env.git_dirty else "")


def not_evidence(env: Environment) -> str | None:
    """Why a file's timings decide no verdict, or None when they may: the one rule for every row of
    every page. A file that did not record the machine's load may have shared its cores with other
    jobs (the CPU machine's older files were taken so), and one whose load was over decides nothing."""
    if env.load is None:
        return "load not recorded"
    if env.load.exceeded:
        return f"over its {env.load.limit}" if env.load.others is None else env.load.why_busy()
    return None


def others(env: Environment) -> str:
    """Other jobs' demand over the run in a few words, as its file records it (the load's ``others``)."""
    if env.load is None:
        return "load not recorded"
    return "other jobs not counted" if env.load.others is None else f"other jobs {env.load.others:.2f} runnable"


def load(env: Environment) -> str:
    """The machine's load around the run (results.environment.Load) and what the host did
    (results.host.Host), or that they were not recorded."""
    if env.load is None:
        return "load not recorded: timings not evidence"
    why = not_evidence(env)
    over = f", {why}: timings not evidence" if why else ""
    text = f"load {env.load.before:.1f} before, {env.load.after:.1f} after on {env.load.cores} cores, {others(env)}{over}"
    if env.host is not None:
        text += f" · {env.host.describe()}" + ("" if env.host.quiet else f": not quiet ({'; '.join(env.host.reasons)})")
    return text


# Changes to the code after which older results no longer measure what the code now does:
# (commit, its time, what changed, the kinds of results it affects).
CODE_CHANGES = (("233eab4", "2026-11-27T10:54:32+00:00", "the sharded optimizer's broadcast rewrite",
                 ("sharded_optimizer", "fsdp_memory")),)


def predates(env: Environment, source: str) -> list[str]:
    """The code changes of :data:`CODE_CHANGES` that a file of ``source``'s kind was taken before."""
    kind = source.rsplit("/", 1)[-1].removesuffix(".json").split("-")[0]
    return [f"taken before {commit} ({what})" for commit, when, what, kinds in CODE_CHANGES
            if kind in kinds and datetime.fromisoformat(env.timestamp_utc) < datetime.fromisoformat(when)]


def caveats(results: Any) -> list[str]:
    """What a file cited outside its setting line must say of itself: the code changes it predates,
    and a missing count of other jobs."""
    env = results.environment
    uncounted = env.load is not None and env.load.others is None
    return [*predates(env, results.source), *(["no count of other jobs"] if uncounted else [])]


def setting_line(env: Environment, source: str, *, device_type: str | None = None, parts: Sequence[str] = ()) -> str:
    """One italic line naming everything a table's numbers depend on, and their file."""
    items = [hardware(env, device_type), *parts]
    if env.shared_gpu:
        items.append("gloo ranks taking turns on one GPU")
    items += [load(env), f"torch {env.torch_version}", commit(env), *predates(env, source), f"from `{source}`"]
    return "*Setting: " + " · ".join(items) + ".*"


def model_name(size: str) -> str:
    """A results file's model size in words: "xl" is the 2025 handout's (the 2026 one's xl is larger)."""
    return "xl of the 2025 handout" if size == "xl" else size


def run_heading(machine: Any, results: Any) -> str:
    """``### Machine `tag` `` and, when the file is not its kind's default one, the file too."""
    extra = "" if results.name == results.kind else f" · `{results.path.name}`"
    return f"### Machine `{machine.tag}`{extra}"


def workload_setting_line(results: Any, *extra: str) -> str:
    """:func:`setting_line` for a run that trained the LM: backend, ranks, model, batch, then ``extra``."""
    env, setting = results.environment, results.setting
    parts = [f"backend {env.backend}", f"world size {env.world_size}", f"model {model_name(setting.get('model_size', '?'))}",
             f"global batch {setting.get('global_batch', '?')} × context {setting.get('context_length', '?')}",
             *extra]
    return setting_line(env, results.source, parts=parts)
