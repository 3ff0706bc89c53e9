"""The writeup's words live in Markdown templates; this fills them in.

Templates are Jinja2 files under ``cs336_systems/writeup/templates/``: ``README.md.j2`` (the
header and the answers), ``answers/<problem>.md.j2`` (one per handout problem) and
``details/<page>.md.j2`` (one per details page). Python computes numbers, tables and figures and
passes them in; a template says what they mean. Numbers are formatted by the filters below,
the functions of :mod:`cs336_systems.writeup.fmt` under the same names, so
``{{ run.median_step_s | ms }}`` writes seconds as milliseconds to three significant digits, and
``{{ n | plural("bucket") }}`` writes "1 bucket" or "3 buckets".

A name a template uses but was not given is an error (``StrictUndefined``), never an empty string.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jinja2

from cs336_systems.writeup import fmt

TEMPLATES = Path(__file__).parent / "templates"
FILTERS = {name: getattr(fmt, name) for name in
           ("sig", "ms", "ms_interval", "us", "gbps", "mb", "gb", "size_mb", "pct", "ratio")}

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    autoescape=False,
)
_ENV.filters.update(FILTERS, plural=lambda n, word: f"{n} {word}{'' if n == 1 else 's'}")


def render(name: str, **values: Any) -> str:
    """Template ``name`` (relative to the templates folder) filled with ``values``.

    Runs of blank lines left by ``{% if %}`` blocks collapse to one, and trailing spaces go, so
    a template can be laid out for its reader without changing the output.
    """
    text = _ENV.get_template(name).render(**values)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
