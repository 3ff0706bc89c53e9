"""From the answer to the library: each row fails on the answers and passes on the library.

The rows are in tests/answer_vs_library.py (what each checks and against what reference); the
writeup page writeup/details/from_answer_to_library.md lists them with the library code each one
costs, and the last test here keeps that page's line counts equal to the source's.
Each row is parametrized over the implementation; on the answers it is expected to fail
(``xfail(strict=True)``: should an answer start to pass, the page is wrong and this test says so).
All rows of a world size run in one spawn, shared by the parametrized tests (one xdist group).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from tests.answer_vs_library import DDP_ROWS, FSDP_ROWS, IMPLS, run_rows
from tests.rank_pool import on_pool

pytestmark = [pytest.mark.problem("beyond"), pytest.mark.xdist_group("answer_vs_library"), pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "writeup" / "details" / "from_answer_to_library.md"
WORLD_SIZE = {row.__name__: 2 for row in DDP_ROWS} | {row.__name__: 3 for row in FSDP_ROWS}


@functools.cache
def findings(world_size: int) -> dict[str, dict[str, str]]:
    """Every row of that world size on both implementations; every rank must agree."""
    rows = DDP_ROWS if world_size == 2 else FSDP_ROWS
    per_rank = on_pool(run_rows, world_size, args=(rows,), timeout_s=300)
    assert all(r == per_rank[0] for r in per_rank), f"ranks disagree: {per_rank}"
    return per_rank[0]


CASES = [pytest.param(name, impl, id=f"{name}-{impl}",
                      marks=[pytest.mark.xfail(strict=True, reason="the answer does not handle this")]
                      if impl == "answers" else [])
         for name in WORLD_SIZE for impl in IMPLS]


@pytest.mark.parametrize("row, impl", CASES)
def test_row(row: str, impl: str):
    found = findings(WORLD_SIZE[row])[row][impl]
    assert found == "", f"{impl}: {found}"


# ---- the page's line counts -----------------------------------------------------------------------
def lines_of(path: str, qualname: str | None) -> int:
    """Lines of a function or class (decorators and docstring included), or of the whole file."""
    source = (REPO / path).read_text()
    if qualname is None:
        return len(source.splitlines())
    nodes = ast.parse(source).body
    node = None
    for part in qualname.split("."):
        node = next((n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        assert node is not None, f"{path} has no {qualname}"
        nodes = node.body
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - first + 1


ROW_LINE = re.compile(r"^\| `(?P<row>\w+)` \|.*\| (?P<where>[^|]+) \| (?P<lines>\d+) \|$")
WHERE = re.compile(r"`(?P<path>[\w/]+\.py)(?::(?P<qualname>[\w.]+))?` \((?P<lines>\d+)\)")


def test_page_rows_and_line_counts_match_the_source():
    """Every row is on the page once; each place it names exists and has the lines the page says."""
    text = PAGE.read_text()
    seen = []
    for line in text.splitlines():
        match = ROW_LINE.match(line)
        if not match:
            continue
        seen.append(match["row"])
        places = list(WHERE.finditer(match["where"]))
        assert places, f"row {match['row']} names no library code: {match['where']}"
        for place in places:
            counted = lines_of(place["path"], place["qualname"])
            assert int(place["lines"]) == counted, f"{place['path']}:{place['qualname']}: page says {place['lines']}, source has {counted}"
        assert int(match["lines"]) == sum(int(p["lines"]) for p in places), f"row {match['row']}: total"
    assert sorted(seen) == sorted(WORLD_SIZE), f"page rows {seen}, tested rows {sorted(WORLD_SIZE)}"
    for name in ("naive_ddp", "ddp_overlap_individual_parameters", "ddp_bucketed", "sharded_optimizer", "fsdp"):
        counted = lines_of(f"cs336_systems/answers/{name}.py", None)
        assert f"`cs336_systems/answers/{name}.py` | {counted} |" in text, f"{name}.py has {counted} lines"
