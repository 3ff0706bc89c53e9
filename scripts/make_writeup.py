"""Render the writeup (README.md and writeup.ipynb, with figures) from the results files.

Reads writeup/results/<machine tag>/*.json (and profile/ beneath each), skipping folders named
quick* (smoke runs) unless named with --include-tag, and writes writeup/README.md,
writeup/writeup.ipynb and writeup/figures/*.png. The same results give byte-identical files.

    make writeup
    python scripts/make_writeup.py
    python scripts/make_writeup.py --include-tag quick-dev --out-dir /tmp/writeup
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cs336_systems.run_metadata import REPO_ROOT
from cs336_systems.writeup import render_writeup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", type=Path, default=REPO_ROOT / "writeup" / "results")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "writeup")
    parser.add_argument("--include-tag", action="append", default=[], metavar="TAG",
                        help="render this results folder even if its name starts with 'quick' (repeatable)")
    args = parser.parse_args(argv)
    try:
        rendered = render_writeup(args.results_dir, args.out_dir, include_tags=args.include_tag)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {rendered.readme}, {rendered.notebook} and {len(rendered.figures)} figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
