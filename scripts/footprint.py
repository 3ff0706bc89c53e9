"""``make footprint``: what grading costs, on a quiet machine (nothing else running), in two runs.

1. The answers graded by this checkout's grader and by the grader of 93fe110 (before issue 38's
   readings from outside), interleaved round by round, at Gradescope's settings (one CPU, half a
   CPU of quota, REPEATS=2): CPU seconds, wall time and the cgroup's peak memory, into
   ``writeup/footprint/<machine tag>/cost.json``. Issue 52's criterion: at most 1.3 times the
   old grader's CPU, a peak under 1 GB.
2. The answers beside the answers whose adapters or model import what ordinary submissions
   import (the course's model libraries, a ``torch.compile``'d function, matplotlib), graded
   by this checkout on one whole CPU, REPEATS=1, interleaved: ``imports.json``. Criterion: each
   at most twice the answers' seconds, 35/35 each.

    python scripts/footprint.py [--runs 3] [--tag TAG]
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cs336_systems import cli  # noqa: E402
from cs336_systems.results.environment import machine_tag  # noqa: E402
from scripts import measure_grading  # noqa: E402
from tests.answers_fixture import build_answers_submission, with_imports  # noqa: E402

OLD_GRADER = "93fe110"
VARIANTS = {"answers": (), "course": ("course",), "compile": ("compile",), "plots": ("plots",)}


@dataclass(frozen=True)
class FootprintSetting:
    runs: int = field(default=3, metadata=cli.count("rounds of each measurement", maximum=100))
    tag: str | None = field(default=None, metadata=cli.option(
        "the folder under writeup/footprint/ (default: this machine's tag)", cli.NAME))


def build_parser() -> cli.Parser:
    return cli.Parser(FootprintSetting, __doc__)


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, _ = build_parser().parse_settings(argv)
    out = Path("writeup/footprint") / (setting.tag or machine_tag())
    with tempfile.TemporaryDirectory(prefix="footprint-") as tmp:
        trees = {name: with_imports(build_answers_submission(Path(tmp) / name), *extra) for name, extra in VARIANTS.items()}
        runs = ["--runs", str(setting.runs), "--edition", "2026"]
        cpus = os.sched_getaffinity(0)
        code = measure_grading.main(["--submissions", str(trees["answers"]), "--labels", "answers", "--graders",
                                     OLD_GRADER, "--cpus", "0", "--quotas", "0.5", "--repeats", "2", *runs,
                                     "--out", str(out / "cost.json")])
        os.sched_setaffinity(0, cpus)  # the first run kept this process off the CPU it measured
        return code or measure_grading.main(["--submissions", *map(str, trees.values()), "--labels", *trees,
                                             "--cpus", "0", "--repeats", "1", *runs, "--out", str(out / "imports.json")])


if __name__ == "__main__":
    sys.exit(main())
