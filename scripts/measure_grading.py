"""What grading one submission costs: peak memory of all its processes together, and wall time,
on a chosen share of the CPUs (the settings a course picks for Gradescope).

Each run starts ``python -m grading SUBMISSION`` in a cgroup of its own (v2, or v1's memory and
cpu controllers) pinned to ``--cpus`` with ``taskset``'s system call, optionally with a CPU
quota (``--quota 0.5``: half a CPU, as ``cpu.max 50000 100000``) and a memory limit, and beside
``--hogs`` busy loops in the same cgroup. Memory is measured two ways: the cgroup's peak
(``memory.peak`` / ``memory.max_usage_in_bytes``: resident memory and page cache, what a
container's limit counts before it reclaims cache) and, by polling every process of the tree from
another CPU every 0.2 s, the peak of the summed RSS and of the summed PSS (shared pages counted
once: the ranks forked from one server share most of torch). The results file records each run.

    python -m tests.answers_fixture /tmp/answers   # the answers as a submission (must not exist)
    python scripts/measure_grading.py --submissions /tmp/answers --cpus 0 --quotas 1 0.5
    python scripts/measure_grading.py --submissions path/to/slow --labels slow --runs 3 --hogs 3 --out /tmp/f.json
    python scripts/measure_grading.py --submissions /tmp/answers --graders 93fe110 --quotas 0.5 --runs 3

Needs root (or a delegated cgroup) for the cgroup; without one it measures by polling only. The
README's numbers: ``writeup/footprint/<machine tag>/``, with this interpreter's torch (Gradescope
installs the CPU build; ``--out`` names where a run goes). Their "slow" submission is the correct
fixture (the old one, tests/fixtures/submission until the answers replaced it) whose package also
imports pandas, triton and wandb at the top, as course-template packages do: every rank pays for
those imports.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from cs336_systems import cli
from cs336_systems.results.environment import collect_environment
from cs336_systems.results.files import atomic_path

REPO = Path(__file__).resolve().parents[1]
MB = 1 << 20
V2 = Path("/sys/fs/cgroup")
V1 = {"memory": Path("/sys/fs/cgroup/memory"), "cpu": Path("/sys/fs/cgroup/cpu"), "cpuacct": Path("/sys/fs/cgroup/cpuacct")}
POLL_S = 0.2


@dataclass
class GradingRun:
    label: str  # which submission
    cpus: str  # the CPUs the run may use (taskset's list)
    quota: float | None  # CPUs' worth of time per period (cpu.max), None: no quota
    memory_limit_mb: int | None
    hogs: int  # busy loops beside it, in its cgroup
    repeats: int
    wall_s: float
    score: float | None  # None: no results.json (the run died)
    possible: float
    failed: list[str] = field(default_factory=list)  # "test: output" of each failed test
    cgroup_peak_mb: float | None = None  # None: no cgroup could be made
    cpu_s: float | None = None  # CPU time of the grading (and its hogs), from the cgroup
    rss_sum_peak_mb: float = 0.0
    pss_sum_peak_mb: float = 0.0
    anon_pss_sum_peak_mb: float = 0.0  # the part no limit can reclaim (no file behind it)
    processes_peak: int = 0
    log_tail: list[str] = field(default_factory=list)  # the suite's last lines, when a test failed
    grader: str = "HEAD"  # the grader's git revision (HEAD: this checkout as it is)
    pair: int = 1  # the round: every grader's run of a submission in one round follows the others'


class Cgroup:
    """A fresh cgroup (v2, else v1 memory+cpu) with an optional CPU quota and memory limit."""

    def __init__(self, name: str, quota: float | None, memory_limit_mb: int | None):
        self.v2 = (V2 / "cgroup.controllers").is_file()
        self.dirs = [V2 / name] if self.v2 else [V1["memory"] / name, V1["cpu"] / name, V1["cpuacct"] / name]
        for d in self.dirs:
            d.mkdir()
        if self.v2:
            (V2 / "cgroup.subtree_control").write_text("+cpu +memory")
        if quota is not None:
            period = 100_000
            if self.v2:
                (self.dirs[0] / "cpu.max").write_text(f"{int(quota * period)} {period}")
            else:
                (self.dirs[1] / "cpu.cfs_period_us").write_text(str(period))
                (self.dirs[1] / "cpu.cfs_quota_us").write_text(str(int(quota * period)))
        if memory_limit_mb is not None:
            limit = str(memory_limit_mb * MB)
            (self.dirs[0] / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(limit)

    def enter(self) -> None:
        """Move the calling process (a child, before exec) into the cgroup."""
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(os.getpid()))

    def peak_mb(self) -> float:
        peak = self.dirs[0] / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        return int(peak.read_text()) / MB

    def cpu_s(self) -> float:
        """CPU seconds its processes used: on a loaded machine, the wall time of the work alone."""
        if self.v2:
            usage = dict(line.split() for line in (self.dirs[0] / "cpu.stat").read_text().splitlines())
            return int(usage["usage_usec"]) / 1e6
        return int((self.dirs[2] / "cpuacct.usage").read_text()) / 1e9

    def remove(self) -> None:
        for d in self.dirs:
            for pid in filter(None, (d / "cgroup.procs").read_text().split()):
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def _rollup(pid: int) -> dict[str, int]:
    """A process's memory totals in KiB (``Rss:``, ``Pss:``, ``Pss_Anon:``, ...); {} once it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return {parts[0]: int(parts[1]) for parts in map(str.split, f) if len(parts) == 3 and parts[2] == "kB"}
    except (OSError, ValueError):
        return {}


def measure(submission: Path, label: str, cpus: str, quota: float | None, memory_limit_mb: int | None, hogs: int,
            repeats: int, edition: str | None, grader: Path = REPO) -> GradingRun:
    cpu_set = {int(c) for c in cpus.split(",")}
    try:
        group: Cgroup | None = Cgroup(f"grading-measure-{os.getpid()}-{time.monotonic_ns()}", quota, memory_limit_mb)
    except OSError as e:
        if quota is not None or memory_limit_mb is not None:
            raise SystemExit(f"--quotas and --memory-limit-mb need a cgroup, and none could be made: {e}") from e
        group = None

    def confine() -> None:
        os.sched_setaffinity(0, cpu_set)
        if group is not None:
            group.enter()

    others = set(range(os.cpu_count() or 1)) - cpu_set
    if others:
        os.sched_setaffinity(0, others)  # the poller stays off the measured CPUs
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"], preexec_fn=confine) for _ in range(hogs)]
    out = Path(tempfile.mkdtemp(prefix="grading-measure-"))
    command = [sys.executable, "-m", "grading", str(submission), "--out", str(out), "--repeats", str(repeats),
               *(["--edition", edition] if edition else [])]
    run = GradingRun(label, cpus, quota, memory_limit_mb, hogs, repeats, 0.0, None, 0.0)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(command, cwd=grader, preexec_fn=confine, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            total = {"Rss:": 0, "Pss:": 0, "Pss_Anon:": 0}
            tree = [root, *root.children(recursive=True)]
            for p in tree:
                for key, kib in _rollup(p.pid).items():
                    if key in total:
                        total[key] += kib * 1024
            run.rss_sum_peak_mb = max(run.rss_sum_peak_mb, total["Rss:"] / MB)
            run.pss_sum_peak_mb = max(run.pss_sum_peak_mb, total["Pss:"] / MB)
            run.anon_pss_sum_peak_mb = max(run.anon_pss_sum_peak_mb, total["Pss_Anon:"] / MB)
            run.processes_peak = max(run.processes_peak, len(tree))
            time.sleep(POLL_S)
        run.wall_s = time.monotonic() - start
        if group is not None:
            run.cgroup_peak_mb = group.peak_mb()
            run.cpu_s = group.cpu_s()
        results = out / "results.json"
        if results.is_file():
            graded = json.loads(results.read_text())
            run.score = graded["score"]
            run.possible = round(sum(t["max_score"] for t in graded["tests"]), 4)
            run.failed = [f"{t['name']}: {t['output'][:300]}" for t in graded["tests"]
                          if t["status"] != "passed" and t["max_score"] > 0]
        if run.failed or run.score is None:
            log = out / "pytest.log"
            run.log_tail = log.read_text(errors="replace").splitlines()[-5:] if log.is_file() else []
    finally:
        for b in busy:
            b.kill()
            b.wait()
        if group is not None:
            group.remove()
        shutil.rmtree(out, ignore_errors=True)
    return run


def _graders(revisions: tuple[str, ...]) -> dict[str, Path]:
    """This checkout (HEAD) and each revision's tree (``git archive``, in a folder removed at
    exit): where ``python -m grading`` runs for it, with this interpreter's packages."""
    import atexit

    folders = {"HEAD": REPO}
    for rev in revisions:
        if rev == "HEAD":
            continue
        folder = Path(tempfile.mkdtemp(prefix=f"grader-{rev.replace('/', '_')}-"))
        atexit.register(shutil.rmtree, folder, True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
        folders[rev] = folder
    return folders


CPU_LIST = cli.Word(r"[0-9]+(,[0-9]+)*", "CPU numbers separated by commas, e.g. 0 or 0,1")


@dataclass(frozen=True)
class MeasureSetting:
    submissions: tuple[Path, ...] = field(default=(), metadata=cli.option(
        "checkouts to grade, one run each per setting", cli.ExistingFolder(), many=True))
    labels: tuple[str, ...] = field(default=(), metadata=cli.option(
        "a name per submission, in order (default: its folder's)", cli.NAME, many=True))
    cpus: str = field(default="0", metadata=cli.option("CPUs the grading may use (taskset's list)", CPU_LIST))
    quotas: tuple[float, ...] = field(default=(), metadata=cli.option(
        "CPUs' worth of time per period, one setting each (0.5: half a CPU); none: no quota",
        cli.Number(0.0, float(os.cpu_count() or 1)), many=True))
    memory_limit_mb: int | None = field(default=None, metadata=cli.option(
        "the cgroup's memory limit", cli.Integer(64, cli.MAX_MB)))
    hogs: int = field(default=0, metadata=cli.count("busy loops beside the grading, on its CPUs and in its cgroup",
                                                   minimum=0, maximum=64))
    repeats: int = field(default=1, metadata=cli.count("REPEATS of the grading", maximum=100))
    runs: int = field(default=1, metadata=cli.count("runs of each setting", maximum=1000))
    edition: str | None = field(default=None, metadata=cli.choice("the edition to grade", ("2025", "2026")))
    graders: tuple[str, ...] = field(default=(), metadata=cli.option(
        "git revisions whose grader grades each submission too, interleaved run by run with this "
        "checkout's (HEAD: this checkout as it is)", cli.Word(r"[0-9A-Za-z._-]+", "a git revision (a commit or tag)"), many=True))
    out: Path = field(default=Path("writeup/footprint/grading.json"), metadata=cli.option(
        "the results file (JSON; not under writeup/results, which the writeup reads)", cli.OutputFile()))

    def validate(self) -> None:
        if not self.submissions:
            raise ValueError("give at least one checkout to grade: --submissions PATH [PATH ...]")
        if len(self.labels) > len(self.submissions):
            raise ValueError(f"{len(self.labels)} labels for {len(self.submissions)} submissions")
        wanted = {int(c) for c in self.cpus.split(",")}
        if not wanted <= os.sched_getaffinity(0):
            raise ValueError(f"--cpus {self.cpus} names CPUs this process may not use {sorted(os.sched_getaffinity(0))}")


def build_parser() -> cli.Parser:
    return cli.Parser(MeasureSetting, __doc__)


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, _ = build_parser().parse_settings(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the cgroup's processes are then killed on the way out
    runs = []
    graders = _graders(setting.graders)
    order = [(r, i, quota, rev) for r in range(setting.runs) for i in range(len(setting.submissions))
             for quota in setting.quotas or (None,) for rev in graders]
    for pair, i, quota, rev in order:  # interleaved: a drift in the machine's speed falls on every grader alike
        submission = setting.submissions[i]
        label = setting.labels[i] if i < len(setting.labels) else submission.resolve().name
        run = measure(submission.resolve(), label, setting.cpus, quota, setting.memory_limit_mb, setting.hogs,
                      setting.repeats, setting.edition, graders[rev])
        run.grader, run.pair = rev, pair + 1
        runs.append(run)
        memory = f"{run.cgroup_peak_mb:.0f}" if run.cgroup_peak_mb is not None else "-"
        cpu = f" ({run.cpu_s:.1f} s of CPU)" if run.cpu_s is not None else ""
        print(f"{label} (grader {rev}): cpus {setting.cpus}, quota {quota}, hogs {setting.hogs}: {run.wall_s:.1f} s{cpu}, "
              f"score {run.score}/{run.possible}, cgroup peak {memory} MB, summed RSS "
              f"{run.rss_sum_peak_mb:.0f} MB, PSS {run.pss_sum_peak_mb:.0f} MB (anonymous {run.anon_pss_sum_peak_mb:.0f} MB), "
              f"{run.processes_peak} processes",
              flush=True)
        for line in [*run.failed[:3], *run.log_tail]:
            print(f"    {line}")
    document = {"kind": "grading_footprint", "environment": asdict(collect_environment("gloo", 3, "cpu")),
                "memory_mb": psutil.virtual_memory().total // MB, "poll_s": POLL_S,
                "setting": {k: [str(x) for x in v] if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v
                            for k, v in asdict(setting).items()},
                "runs": [asdict(r) for r in runs]}
    with atomic_path(setting.out) as tmp:
        tmp.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"written: {setting.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
