"""Check that this Python already has every package the project needs (``make <target> UV=0``).

    python3 scripts/check_env.py

For machines without network (cluster GPU nodes often have none), where ``uv sync`` cannot
install the locked environment: reads the dependencies from pyproject.toml, and exits 2 naming
every one that is missing here (with the pip line that installs them), else prints the
versions found and exits 0. Imports nothing from the project.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def required_distributions(pyproject: Path = PYPROJECT) -> list[str]:
    """Distribution names of ``[project] dependencies`` (version bounds dropped)."""
    with open(pyproject, "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    return [re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0] for d in dependencies]


def build_parser() -> argparse.ArgumentParser:
    """No options: the dependencies come from pyproject.toml."""
    return argparse.ArgumentParser(description=__doc__.splitlines()[0])


def main(argv: list[str] | None = None, pyproject: Path = PYPROJECT) -> int:
    build_parser().parse_args(argv)
    found, missing = {}, []
    for name in required_distributions(pyproject):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        print(
            f"error: {sys.executable} lacks {len(missing)} package(s) this project needs: "
            f"{', '.join(missing)}\n"
            f"  install them there (python3 -m pip install {' '.join(missing)}; without network, "
            "from wheels copied to the machine), or run make without UV=0 where uv can reach PyPI",
            file=sys.stderr,
        )
        return 2
    print(f"{sys.executable}: " + ", ".join(f"{name} {version}" for name, version in found.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
