"""Render the writeup (README.md with the answers, details/*.md, writeup.ipynb, figures) from the results files.

Reads writeup/results/<machine tag>/*.json (and profile/ beneath each), skipping folders named
quick* (smoke runs) unless named with --include-tag, and writes writeup/README.md,
writeup/details/*.md, writeup/writeup.ipynb and writeup/figures/*.png, each atomically. A results file that cannot be
read is named in the writeup and set aside; the rest renders. The same results give
byte-identical files.

    make writeup
    python scripts/make_writeup.py
    python scripts/make_writeup.py --include-tag quick --out-dir /tmp/writeup
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from cs336_systems import cli
from cs336_systems.results.environment import REPO_ROOT
from cs336_systems.results.paths import RESULTS_ROOT
from cs336_systems.writeup import render_writeup


@dataclass(frozen=True)
class WriteupSetting:
    results_dir: Path = field(default=RESULTS_ROOT, metadata=cli.option(
        "where the results folders are", cli.ExistingFolder()))
    out_dir: Path = field(default=REPO_ROOT / "writeup", metadata=cli.option(
        "where README.md, details/, writeup.ipynb and figures/ go", cli.OutputFolder()))
    include_tag: tuple[str, ...] = field(default=(), metadata=cli.option(
        "render these results folders even if their names start with 'quick'", cli.FOLDER_NAME, many=True))


def build_parser() -> cli.Parser:
    return cli.Parser(WriteupSetting, __doc__)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    setting, _ = parser.parse_settings(argv)
    rendered = render_writeup(setting.results_dir, setting.out_dir, include_tags=setting.include_tag)
    print(f"wrote {rendered.readme}, {len(rendered.details)} details pages, {rendered.notebook} "
          f"and {len(rendered.figures)} figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
