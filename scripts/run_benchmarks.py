"""Run a benchmark suite (cs336_systems/bench_suites.py) and then render the writeup.

    python scripts/run_benchmarks.py --suite cpu      # make bench
    python scripts/run_benchmarks.py --suite quick    # make bench-quick (smoke check)
    python scripts/run_benchmarks.py --suite gpu      # make bench-gpu (1-6 GPUs)

Each step runs as its own process; a failing step stops the suite with its exit code.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from cs336_systems.bench_suites import cpu_suite, gpu_suite, quick_suite
from cs336_systems.run_metadata import REPO_ROOT, results_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=["cpu", "quick", "gpu"], required=True)
    parser.add_argument("--tag", default=None, help="results folder (default: machine tag; 'quick' for --suite quick)")
    parser.add_argument("--no-writeup", action="store_true", help="skip rendering the writeup at the end")
    args = parser.parse_args(argv)

    tag = args.tag or ("quick" if args.suite == "quick" else None)
    out = results_dir(tag)
    try:
        if args.suite == "gpu":
            steps = gpu_suite(str(out), torch.cuda.device_count() if torch.cuda.is_available() else 0)
        else:
            steps = (quick_suite if args.suite == "quick" else cpu_suite)(str(out))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"suite {args.suite}: {len(steps)} steps, results in {out.relative_to(REPO_ROOT)}")
    started = time.monotonic()
    for step in tqdm(steps, desc=f"bench {args.suite}", unit="step"):
        tqdm.write(f"--- {step.name}: python {step.script} {' '.join(step.args)}")
        step_start = time.monotonic()
        done = subprocess.run([sys.executable, str(REPO_ROOT / step.script), *step.args], cwd=REPO_ROOT)
        tqdm.write(f"--- {step.name}: exit {done.returncode} after {time.monotonic() - step_start:.0f} s")
        if done.returncode != 0:
            print(f"error: step '{step.name}' failed with exit code {done.returncode}", file=sys.stderr)
            return done.returncode
    print(f"suite {args.suite} finished in {time.monotonic() - started:.0f} s")
    if args.no_writeup or args.suite == "quick":
        return 0
    return subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "make_writeup.py")], cwd=REPO_ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
