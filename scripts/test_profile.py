"""``make test-profile``: run the suite as ``make test`` does and write what each file and kind of test costs.

    python scripts/test_profile.py [--out tests/PROFILE.md]
    python scripts/test_profile.py --from DIR [--out FILE]   # re-write the breakdown from a run's records

The run is ``pytest -n auto --dist loadgroup --durations=0`` with the cost plugin (tests/cost_profile.py),
whose records (one JSON line per test) land in a scratch folder; this script then writes a Markdown
breakdown: pytest's own time, the load average over the run (sampled every 15 s), and per file and per
kind the tests, their wall time (summed over the workers, so above pytest's own time), the CPU time of
the test processes and of the ranks and subprocesses they reaped, and the fixed costs they paid:
processes spawned (ranks), subprocesses, gradings, renders, seconds slept. Timings taken on a loaded
machine are not evidence of the quiet machine's: the file says the load beside them. ``--from`` reads
a folder of records (``run.json`` beside them, if there, gives the run's facts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cs336_systems import cli  # noqa: E402

PROFILE_DIR_ENV = "CS336_TEST_PROFILE_DIR"  # tests/cost_profile.py reads it
# A test's kind: the first of these costs it paid (a grading spawns ranks too; a spawn may render).
KINDS = (("grading", lambda r: r.get("gradings", 0) + r.get("folder_gradings", 0) > 0),
         ("ranks spawned", lambda r: r.get("processes", 0) > 0),
         ("subprocess", lambda r: r.get("subprocesses", 0) > 0),
         ("render", lambda r: r.get("renders", 0) > 0),
         ("sleep", lambda r: r.get("sleep_s", 0) >= 0.5),
         ("in-process", lambda r: True))
COLUMNS = ("tests", "wall s", "CPU s (tests)", "CPU s (children)", "ranks", "subprocs", "gradings", "renders", "slept s")


def kind_of(record: dict) -> str:
    return next(name for name, applies in KINDS if applies(record))


def totals(records: list[dict]) -> list[str]:
    def total(key: str) -> float:
        return sum(r.get(key, 0) for r in records)
    return [str(len(records)), f"{total('wall_s'):.0f}", f"{total('cpu_s'):.0f}", f"{total('children_cpu_s'):.0f}",
            f"{total('processes'):.0f}", f"{total('subprocesses'):.0f}",
            f"{total('gradings'):.0f}" + (f" + {total('folder_gradings'):.0f} folders" if total('folder_gradings') else ""),
            f"{total('renders'):.0f}", f"{total('sleep_s'):.1f}"]


def table(rows: list[tuple[str, list[dict]]], first: str) -> list[str]:
    lines = [f"| {first} | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    for name, records in rows:
        lines.append(f"| {name} | " + " | ".join(totals(records)) + " |")
    return lines


def cpu_of(records: list[dict]) -> float:
    return sum(r.get("cpu_s", 0) + r.get("children_cpu_s", 0) for r in records)


def read_records(folder: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines()]


def breakdown(records: list[dict], run: dict) -> str:
    by_file, by_kind = defaultdict(list), defaultdict(list)
    for record in records:
        by_file[record["file"]].append(record)
        by_kind[kind_of(record)].append(record)
    kinds = [(name, by_kind[name]) for name, _ in KINDS if by_kind[name]]
    files = sorted(by_file.items(), key=lambda item: -cpu_of(item[1]))
    slowest = sorted(records, key=lambda r: -r["wall_s"])[:25]
    lines = ["# What `make test` costs, by file and by kind", "",
             f"Made by `make test-profile` (scripts/test_profile.py, the cost plugin tests/cost_profile.py). {run['what']}",
             "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in run["facts"].items()]
    lines += ["", "Wall seconds are summed over the workers (so above pytest's own time); CPU seconds are the test "
              "processes' own and their children's: ranks and subprocesses reaped, and those still running, as a rank "
              "pool's ranks (a grandchild its parent reaped counts; a daemon nobody waited for does not). A session or module fixture's cost "
              "lands on the first test that uses it. A test's kind is the first fixed cost it paid, in the order "
              "of the table.", "", "## By kind", ""]
    lines += table(kinds, "kind")
    lines += ["", "## By file (most CPU first)", ""]
    lines += table(files, "file")
    lines += ["", "## The 25 slowest tests (wall)", "", "| test | kind | wall s | CPU s (tests + children) |", "|---|---|---|---|"]
    lines += [f"| `{r['nodeid']}` | {kind_of(r)} | {r['wall_s']:.1f} | {r.get('cpu_s', 0) + r.get('children_cpu_s', 0):.1f} |"
              for r in slowest]
    return "\n".join(lines) + "\n"


class LoadSampler(threading.Thread):
    """The 1-minute load average every ``interval_s`` while the suite runs."""

    def __init__(self, interval_s: float = 15.0) -> None:
        super().__init__(daemon=True)
        self.interval_s, self.samples, self.stopped = interval_s, [], threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.samples.append(os.getloadavg()[0])
            self.stopped.wait(self.interval_s)


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        model = found.group(1).strip() if found else model
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {model}"


def commit() -> str:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (done.stdout.strip() or "unknown") + ("+changes" if dirty else "")


def profile_run(folder: Path) -> dict:
    command = [sys.executable, "-m", "pytest", "-p", "tests.cost_profile", "-n", "auto", "--dist", "loadgroup",
               "--durations=0"]
    sampler = LoadSampler()
    before = os.getloadavg()[0]
    sampler.start()
    start = time.monotonic()
    done = subprocess.run(command, cwd=REPO, env={**os.environ, PROFILE_DIR_ENV: str(folder)}, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - start
    sampler.stopped.set()
    sampler.join()
    print(done.stdout[-4000:])
    summary = next((line.strip("= ") for line in reversed(done.stdout.splitlines()) if " in " in line and "=" in line), "")
    samples = sampler.samples or [before]
    return {"status": done.returncode, "what": f"`{' '.join(command[1:])}`",
            "facts": {"machine": machine(), "commit": commit(), "pytest's own time": summary or f"{seconds:.0f} s",
                      "load average (1 min) over the run": f"{before:.1f} before; {min(samples):.1f} to "
                      f"{max(samples):.1f}, mean {sum(samples) / len(samples):.1f} while it ran ({len(samples)} samples)"}}


@dataclass(frozen=True)
class ProfileSetting:
    out: Path = field(default=REPO / "tests" / "PROFILE.md", metadata=cli.option("the breakdown to write", cli.OutputFile()))
    source: Path | None = field(default=None, metadata=cli.option(
        "write the breakdown from this folder of an earlier run's records instead of running the suite",
        cli.ExistingFolder(), flag="--from"))


def build_parser() -> cli.Parser:
    return cli.Parser(ProfileSetting, __doc__)


def main(argv: list[str] | None = None) -> int:
    setting, _ = build_parser().parse_settings(argv)
    if setting.source:
        facts = setting.source / "run.json"
        run = {"status": 0, "what": "Records of an earlier run.", "facts": {"machine": machine()}}
        if facts.is_file():
            run.update(json.loads(facts.read_text()))
        records = read_records(setting.source)
    else:
        with tempfile.TemporaryDirectory(prefix="test-profile-") as folder:
            run = profile_run(Path(folder))
            records = read_records(Path(folder))
    setting.out.write_text(breakdown(records, run))
    print(f"written: {setting.out} ({len(records)} tests)")
    return run["status"]


if __name__ == "__main__":
    sys.exit(main())
