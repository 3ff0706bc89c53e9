"""Run a benchmark suite (cs336_systems/bench/suites.py), then render the writeup.

    python scripts/run_benchmarks.py --suite cpu      # make bench
    python scripts/run_benchmarks.py --suite quick    # make bench-quick (smoke check)
    python scripts/run_benchmarks.py --suite gpu      # make bench-gpu (1-6 GPUs)
    python scripts/run_benchmarks.py --suite gpu-memory   # one GPU: xl memory, claims at world size 1
    python scripts/run_benchmarks.py --suite retake   # make bench-retake: make bench's steps whose cited
                                                      # file is not quiet evidence, on a quiet machine

Each step runs as its own process and writes its own results file, atomically. A failing
step stops the suite; SIGTERM or Ctrl-C stops the running step (and its ranks). Either way the
results files of the finished steps stay, and the last lines say which steps are missing and
the command that reruns the suite. At the end, every file the suite wrote that is not quiet evidence
is named with the reason (a run the host disturbed is filed under ``not-quiet/`` where a quieter
one was in place: see results.files.save_results).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from cs336_systems import cli
from cs336_systems.cli.parser import LOADED_EXIT_STATUS
from cs336_systems.bench.suites import (BenchStep, cpu_suite, gpu_suite, one_gpu_memory_steps, quick_suite,
                                        retake_reason, retake_suite)
from cs336_systems.launch import Interrupted
from cs336_systems.launch.signals import raising_on_signals
from cs336_systems.results.environment import REPO_ROOT, settle_load
from cs336_systems.results.paths import NOT_QUIET_DIR, results_dir

SUITES = {"cpu": "make bench", "quick": "make bench-quick", "gpu": "make bench-gpu",
          "gpu-memory": "python scripts/run_benchmarks.py --suite gpu-memory", "retake": "make bench-retake"}
STEP_STOP_GRACE_S = 30.0  # a stopped step's launcher stops its own ranks within 10 s


@dataclass(frozen=True)
class SuiteSetting:
    suite: str = field(default="cpu", metadata=cli.choice("which suite", SUITES))
    tag: str | None = field(default=None, metadata=cli.option(
        "results folder under writeup/results (default: this machine's tag; 'quick' for the quick suite)",
        cli.FOLDER_NAME))
    no_writeup: bool = field(default=False, metadata=cli.switch("skip rendering the writeup at the end"))


def build_parser() -> cli.Parser:
    return cli.Parser(SuiteSetting, __doc__)


def suite_steps(setting: SuiteSetting) -> tuple[Path, list[BenchStep]]:
    out = results_dir(setting.tag or ("quick" if setting.suite == "quick" else None))
    if setting.suite == "gpu-memory":
        return out, one_gpu_memory_steps(out)
    if setting.suite == "retake":
        return out, retake_suite(out)
    if setting.suite == "gpu":
        return out, gpu_suite(out, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    return out, (quick_suite if setting.suite == "quick" else cpu_suite)(out)


def _run_step(step: BenchStep) -> int:
    """The step's exit status; on a signal, the step is stopped too and Interrupted is raised."""
    process = subprocess.Popen([sys.executable, *step.command], cwd=REPO_ROOT)
    try:
        with raising_on_signals():
            return process.wait()
    except Interrupted as e:
        if process.poll() is None:
            process.send_signal(e.signum)
            try:
                process.wait(STEP_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        raise


def _report_missing(steps: list[BenchStep], finished: list[BenchStep], suite: str) -> None:
    missing = [s for s in steps if s not in finished]
    if finished:
        print("kept: " + ", ".join(f"{s.name} ({Path(s.out).name})" for s in finished), file=sys.stderr)
    print(f"missing: {', '.join(s.name for s in missing)}; `{SUITES[suite]}` reruns the suite", file=sys.stderr)


def _report_quiet(steps: list[BenchStep]) -> None:
    """Each written file that is not quiet evidence, and why; the runs filed apart from a quieter one."""
    for step in steps:
        out = Path(step.out)
        apart = out.parent / NOT_QUIET_DIR / out.name
        if apart.is_file() and out.is_file() and apart.stat().st_mtime >= out.stat().st_mtime:
            print(f"not quiet: {step.name}: filed as {apart}, {retake_reason(apart)}; the quieter {out.name} stays",
                  file=sys.stderr)
        elif (why := retake_reason(out)) is not None:
            print(f"not quiet: {step.name} ({out.name}): {why}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    setting, _ = parser.parse_settings(argv)
    try:
        out, steps = suite_steps(setting)
    except ValueError as e:
        parser.error(str(e))
    print(f"suite {setting.suite}: {len(steps)} steps, results in {out.relative_to(REPO_ROOT)}")
    started = time.monotonic()
    finished: list[BenchStep] = []
    refused: list[BenchStep] = []
    for step in tqdm(steps, desc=f"bench {setting.suite}", unit="step"):
        if setting.suite != "quick":
            tqdm.write(f"--- load average {settle_load():.1f} (what ran before is gone)")
        tqdm.write(f"--- {step.name}: python {' '.join(step.command)}")
        step_start = time.monotonic()
        try:
            status = _run_step(step)
        except Interrupted as e:
            print(f"interrupted: {e}, during step '{step.name}'", file=sys.stderr)
            _report_missing(steps, finished, setting.suite)
            return e.exit_status
        tqdm.write(f"--- {step.name}: exit {status} after {time.monotonic() - step_start:.0f} s")
        if status == LOADED_EXIT_STATUS and setting.suite == "retake":
            # Refused for other jobs' load: the quiet steps after it are still worth taking.
            refused.append(step)
            continue
        if status != 0:
            print(f"error: step '{step.name}' failed with exit status {status}", file=sys.stderr)
            _report_missing(steps, finished, setting.suite)
            return status if status > 0 else 128 - status
        finished.append(step)
    print(f"suite {setting.suite} finished in {time.monotonic() - started:.0f} s")
    _report_quiet(finished)
    if refused:
        print(f"refused for other jobs' load (nothing written): {', '.join(s.name for s in refused)}; "
              f"`{SUITES[setting.suite]}` again on a quieter machine retakes them", file=sys.stderr)
    if setting.no_writeup or setting.suite == "quick":
        return 0
    return subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "make_writeup.py")], cwd=REPO_ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
