"""The whole writeup: built only from results files, complete, honest about gaps, reproducible.

The results tree is the one tests/test_writeup_ddp.py plants through the benchmarks' own writers
(all-reduce, naive-DDP check, step benchmark and ablation, profile, a one-GPU rehearsal), plus a
grade table as ``make test`` writes it and a smoke folder that must stay out. Each section has
its own tests of its sentences; these check what holds for the page as a whole. Nothing spawns
a process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from cs336_systems.problems import PROBLEMS, GradeRecord
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import RESULTS_ROOT, results_path
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.render import heading
from cs336_systems.writeup.pages import machines_page

from .test_writeup_allreduce import PAYLOADS, environment, record
from .test_writeup_ddp import TAG, answers, build_results_tree, committed_outputs, output_files

REPO = Path(__file__).resolve().parents[1]

# One worker renders the shared tree once (the Makefile runs pytest with --dist loadgroup).
pytestmark = [pytest.mark.problem("beyond"), pytest.mark.xdist_group("writeup")]

SMOKE_TAG = "quick-smoke"
SMOKE_MEDIAN_S = 0.0456789  # only in the smoke folder: "45.7" ms must not be rendered
TIMESTAMP = "2031-01-02T03:04:05+00:00"
GRADES = [
    GradeRecord("naive_ddp", 23, 23, 0, 5.0, 5, {"tests/test_ddp_equivalence.py": [23, 23]}, []),
    GradeRecord("fsdp", 7, 8, 0, 13.1, 15, {"tests/test_fsdp.py": [7, 8]}, ["tests/test_fsdp.py::test_x[fp32]"]),
    GradeRecord("beyond", 300, 300, 1, None, None, {"tests/test_bad_inputs.py": [250, 250],
                                                    "tests/test_signals.py": [5, 5]}, []),
]


def plant_extras(results: Path) -> None:
    """A smoke run the writeup must skip and the grade table of a test run."""
    smoke = [record("gloo", "cpu", 2, payload, [SMOKE_MEDIAN_S] * 3) for payload in PAYLOADS]
    write_results(results / SMOKE_TAG / "allreduce.json", ResultsFile("allreduce", environment(), {}, smoke))
    env = environment()
    write_results(results_path(GradeRecord.KIND, TAG, root=results),
                  ResultsFile(GradeRecord.KIND, env, {"pytest_args": ["-n", "auto"]}, GRADES))


# Words of prose (display formulas, tables, figures and setting lines are not counted) per lettered
# part of an answer, the handout's unit of "2-3 sentences": the answer first, the rest on its
# details page. The 2026 section 8 answers: an expression and its justification each.
ANSWER_WORDS, ANSWERS_WORDS, HEADER_WORDS = 200, 3600, 150


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("writeup")
    results = build_results_tree(root)
    plant_extras(results)
    first = render_writeup(results, root / "a")
    render_writeup(results, root / "b")
    return {"root": root, "results": results, "first": first, "text": first.text(),
            "readme": first.readme.read_text(), "page": {p.stem: p.read_text() for p in first.details}}


def test_rendering_twice_gives_byte_identical_files(rendered):
    a, b = output_files(rendered["root"] / "a"), output_files(rendered["root"] / "b")
    assert sorted(a) == sorted(b)
    assert {"README.md", "writeup.ipynb", "details/machines.md"} <= set(a)
    assert sum(name.startswith("figures/") for name in a) >= 5
    for name in a:
        assert a[name] == b[name], f"{name} differs between two renders of the same results"


def test_stale_figures_and_pages_are_removed(rendered, tmp_path):
    stale = [tmp_path / "figures" / "from-a-machine-that-is-gone.png", tmp_path / "details" / "gone.md"]
    for path in stale:
        path.parent.mkdir()
        path.write_bytes(b"old")
    render_writeup(rendered["results"], tmp_path, pages=[machines_page])
    assert not any(path.exists() for path in stale)


def test_the_readme_opens_with_a_short_header_then_answers_every_problem_in_order(rendered):
    readme = rendered["readme"]
    header = readme.split("\n## Answers\n")[0]
    assert len(header.split()) <= HEADER_WORDS
    assert [line for line in readme.splitlines() if line.startswith("## ")] == ["## Answers", "## Details"]
    assert list(answers(readme)) == [p.name for p in PROBLEMS]


def prose_words(text: str) -> int:
    """Words of prose: display formulas, table rows, figures and the italic setting lines (what was
    run, on what) are data, not the answer's sentences."""
    text = re.sub(r"\$\$.*?\$\$", "", text, flags=re.S)
    prose = [line for line in text.splitlines() if not line.lstrip().startswith(("|", "![", "*Setting:"))]
    return len("\n".join(prose).split())


@pytest.mark.parametrize("which", ["planted", "committed"])
def test_answers_keep_to_the_handouts_length(rendered, which):
    readme = rendered["readme"] if which == "planted" else (REPO / "writeup" / "README.md").read_text()
    found = answers(readme)
    for problem, text in found.items():
        for part in re.split(r"\*\*\([a-d]\)", text):  # each lettered deliverable on its own
            assert prose_words(part) <= ANSWER_WORDS, f"{problem}: {prose_words(part)} words in {part[:60]!r}"
    assert sum(prose_words(t) for t in found.values()) <= ANSWERS_WORDS


# The handout's sentence limit per lettered part of an answer ("": an answer without parts), from the
# deliverables of the 2025 handout (DDP, communication_accounting) and the 2026 one (FSDP, section 8).
# A deliverable of measured times plus N sentences gets N + 1 where no table carries the times.
SENTENCE_LIMITS = {
    "distributed_communication_single_node": {"": 3},  # "with 2-3 sentences of commentary"
    "minimal_ddp_flat_benchmarking": {"": 3},  # "The measured time ... 1-2 sentences comparing"
    "ddp_overlap_individual_parameters_benchmarking": {"a": 2},  # a table, "with 1-2 sentences comparing"
    "ddp_bucketed_benchmarking": {"a": 4},  # "3-4 sentence commentary"
    "communication_accounting": {"a": 1, "b": 1, "c": 1},  # "Your calculations and a one-sentence response"
    "optimizer_state_sharding_accounting": {"a": 3, "b": 3, "c": 3},  # "2-3 sentence response"
    "fsdp_accounting": {"a": 3, "b": 3},  # "2-3 sentence response"
    "alternate_ring_all_reduce": {"": 1},  # "a one-sentence justification"
    "data_parallel_calcs": {"a": 1, "b": 1, "c": 1},  # "a one-sentence justification"
    "fsdp_calcs": {"a": 2, "b": 2, "c": 2},  # "two one-sentence justifications"
    "tp_calcs": {"b": 2, "c": 2, "d": 2},  # "two one-sentence justifications"
    "fsdp_tp_calcs": {"a": 1, "b": 1, "c": 4, "d": 4},  # "one-sentence"; "a few sentences and equations"
}
ONE_PARAGRAPH = {"communication_accounting": "d"}  # "A one-paragraph response"
# Not the answer's sentences: what was run and on what, tables, figures, formulas, the code and tests
# a problem is graded by, the pointer to what was not measured, and section 8's checks of a formula.
NOT_COUNTED = ("|", "![", "*Setting:", "*Checked by*", "Not measured", "Code:", "Graded by")


def lettered_parts(answer: str) -> dict[str, str]:
    """An answer's text by lettered part, "**(a)**" to the next; "" holds what comes before any."""
    pieces = re.split(r"\*\*\(([a-d])\)", answer)
    parts = {"": pieces[0]}
    for letter, body in zip(pieces[1::2], pieces[2::2]):
        parts[letter] = parts.get(letter, "") + body
    return parts


def prose_paragraphs(text: str) -> list[str]:
    """The paragraphs that are prose (see NOT_COUNTED), formulas taken out."""
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.S)
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip() and not p.strip().startswith(NOT_COUNTED)]


def sentences(text: str) -> list[str]:
    """The sentences of ``text``'s prose: split after ".", "!" or "?", not inside parentheses, inline
    formulas, decimals or abbreviations, and without a sentence that is only a link to the details."""
    prose = " ".join(line for p in prose_paragraphs(text) for line in p.splitlines()
                     if not line.lstrip().startswith(NOT_COUNTED))
    prose = re.sub(r"\$[^$]*\$", "x", prose)
    prose = re.sub(r"(^|(?<=[.!?:]) )\[[^\]]+\]\([^)]+\)\.", " ", prose)
    prose = re.sub(r"\]\([^)]+\)", "]", prose)
    while re.search(r"\([^()]*\)", prose):
        prose = re.sub(r"\([^()]*\)", "", prose)
    prose = re.sub(r"\d\.\d", "0", prose)
    prose = re.sub(r"\b(e\.g|i\.e|et al|Sec|vs|cf)\.", r"\1", prose)
    return [s for s in re.split(r"(?<=[.!?])[*_]*\s+", prose) if re.search(r"\w", s)]


def test_sentences_are_counted_as_a_reader_counts_them():
    assert len(sentences("**(a)** One (e.g. two. three) is 1.5 ms. Two: $x. y$ here. [Details](d.md).")) == 2
    assert len(sentences("| a. | b. |\n\n*Setting: x. y.*\n\nOne.\n\n$$a. b.$$\n\nTwo!")) == 2


@pytest.mark.parametrize("which", ["planted", "committed"])
def test_answers_keep_to_the_handouts_sentence_limits(rendered, which):
    readme = rendered["readme"] if which == "planted" else (REPO / "writeup" / "README.md").read_text()
    found = answers(readme)
    over = []
    for problem, limits in SENTENCE_LIMITS.items():
        parts = lettered_parts(found.get(problem, ""))
        for letter, limit in limits.items():
            if len(counted := sentences(parts.get(letter, ""))) > limit:
                over.append(f"{problem} ({letter or 'whole'}): {len(counted)} sentences, the handout asks at most "
                            f"{limit}: {counted}")
    for problem, letter in ONE_PARAGRAPH.items():
        if len(paragraphs := prose_paragraphs(lettered_parts(found.get(problem, "")).get(letter, ""))) > 1:
            over.append(f"{problem} ({letter}): {len(paragraphs)} paragraphs, the handout asks one")
    assert not over, "\n".join(over)


def test_every_details_page_is_linked_from_the_readme(rendered):
    for page in rendered["page"]:
        assert f"(details/{page}.md)" in rendered["readme"]


def test_the_problem_map_reads_the_grade_table(rendered):
    table = rendered["page"]["grading"]
    assert "| [`naive_ddp`](../README.md#naive_ddp) | 5 |" in table and "23/23 passed" in table and "7/8 passed" in table
    assert "`tests/test_fsdp.py::test_x[fp32]`" in table  # a failing test is named
    assert "`tests/test_bad_inputs.py`: 250 bad values" in table and "250 of 250 passed" in table
    assert "23/23 passed" in answers(rendered["readme"])["naive_ddp"]


def test_settings_are_named_and_no_time_of_rendering_leaks(rendered):
    text = rendered["text"]
    assert "logical cores" in text and "torch " in text and "commit " in text
    assert TIMESTAMP not in text and "2031" not in text


def test_what_was_not_measured_is_listed_once_with_its_command(rendered):
    machines = rendered["page"]["machines"]
    assert "## Not measured here" in machines and "`make bench-gpu`" in machines
    assert rendered["text"].count("## Not measured here") == 1


def test_smoke_folders_are_left_out_unless_asked_for(rendered, tmp_path):
    smoke_ms = f"{SMOKE_MEDIAN_S * 1e3:.1f}"
    assert SMOKE_TAG not in rendered["text"] and smoke_ms not in rendered["text"]
    included = render_writeup(rendered["results"], tmp_path / "out", include_tags=[SMOKE_TAG],
                              pages=[machines_page]).text()
    assert f"`{SMOKE_TAG}`" in included


def test_notebook_validates_and_carries_the_answers_first(rendered):
    nb = nbformat.read(rendered["first"].notebook, as_version=4)
    nbformat.validate(nb)
    assert [c.id for c in nb.cells] == [f"cell-{i:04d}" for i in range(1, len(nb.cells) + 1)]
    assert all(c.cell_type == "markdown" for c in nb.cells)
    found = answers(rendered["readme"])
    assert len(nb.cells) == 1 + len(found) + len(rendered["page"])
    assert ["\n".join(c.source.splitlines()[:2]) for c in nb.cells[1:len(found) + 1]] == [heading(p) for p in found]
    assert nb.cells[1].source.strip() == f"{heading(PROBLEMS[0].name)}\n\n{found[PROBLEMS[0].name].strip()}"
    assert rendered["first"].notebook.read_bytes().endswith(b"\n")


def anchors(markdown: str) -> set[str]:
    """The fragments a link may name in a page: explicit ids, and headings as GitHub slugs them."""
    ids = set(re.findall(r'<a id="([^"]+)"></a>', markdown))
    for heading in re.findall(r"^#+ (.+)$", markdown, flags=re.M):
        ids.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return ids


def links(out: Path) -> tuple[list[str], int, int]:
    """Broken relative links (file or fragment) in a rendered writeup, and how many images and fragments it links."""
    broken, images, fragments = [], 0, 0
    for path in [out / "README.md", *sorted((out / "details").glob("*.md"))]:
        for link, fragment in re.findall(r"\]\(([^)#\s]+)(?:#([^)]*))?\)", path.read_text()):
            if re.match(r"[a-z]+:", link):
                continue
            target = path.parent / link
            images += link.endswith(".png")
            if not target.is_file():
                broken.append(f"{path.name}: {link}")
            elif fragment and link.endswith(".md"):
                fragments += 1
                if fragment not in anchors(target.read_text()):
                    broken.append(f"{path.name}: {link}#{fragment}")
    return broken, images, fragments


def test_figures_pages_and_anchors_are_linked_relative_to_where_they_are_read(rendered):
    broken, images, fragments = links(rendered["root"] / "a")
    assert broken == [] and images >= 5 and fragments >= 3


def test_no_results_at_all_renders_every_gap_with_its_command(tmp_path):
    rendered = render_writeup(tmp_path / "no-results", tmp_path / "out")
    assert list(answers(rendered.readme.read_text())) == [p.name for p in PROBLEMS]
    text = rendered.text()
    assert "make bench-gpu" in text and "`make bench`" in text and "`make test`" in text
    assert not re.search(r"\d+\.\d+ ms", text)  # not a single measured time


@pytest.mark.parametrize("damage", ["truncated", "not-results", "other-version"])
def test_an_unreadable_results_file_is_named_and_the_rest_renders(rendered, tmp_path, damage):
    results = build_results_tree(tmp_path)
    path = results / TAG / "allreduce.json"
    if damage == "truncated":  # what a run killed while writing would leave, were files not renamed into place
        path.write_text(path.read_text()[:200])
    elif damage == "not-results":
        path.write_text('["not", "records"]\n')
    else:
        document = json.loads(path.read_text())
        document["version"] = 99
        path.write_text(json.dumps(document))
    out = render_writeup(results, tmp_path / "out")
    text = out.text()
    assert f"Unreadable: `{TAG}/allreduce.json`, set aside" in text
    assert str(tmp_path) not in text  # no path of the machine that rendered it
    assert re.search(r"\d+\.\d+ ms", (tmp_path / "out" / "details" / "ddp_step.md").read_text())


def table_rows(text: str) -> list[str]:
    """A markdown text's table body rows (headers and separator lines left out)."""
    lines = text.splitlines()
    rows = []
    for i, line in enumerate(lines):
        is_separator = re.fullmatch(r"\|[\s:|-]+\|", line.strip()) is not None
        is_header = i + 1 < len(lines) and re.fullmatch(r"\|[\s:|-]+\|", lines[i + 1].strip()) is not None
        if line.startswith("|") and not is_separator and not is_header:
            rows.append(line.strip())
    return rows


def repeated_rows(documents: list[str]) -> list[str]:
    rows = [row for text in documents for row in table_rows(text)]
    return sorted({row for row in rows if rows.count(row) > 1})


def test_no_table_row_appears_twice(rendered):
    assert repeated_rows([rendered["readme"], *rendered["page"].values()]) == []


def test_the_committed_writeup_is_what_the_committed_results_render(committed_writeup):
    """What `make writeup` would change on this machine: nothing (figures and tables carry no float noise)."""
    committed = REPO / "writeup"
    out, rendered = committed_writeup
    assert repeated_rows([p.read_text() for p in [rendered.readme, *rendered.details]]) == []
    assert links(out)[0] == []
    fresh, kept = output_files(out), committed_outputs(committed)
    assert sorted(fresh) == sorted(kept)
    assert [name for name in sorted(fresh) if fresh[name] != kept[name]] == [], "rerun `make writeup` and commit"


# The whole of one answer, display formulas included (a TA's count of a written answer), leaving
# out only tables, figures and setting lines.
ANSWER_TOTAL_WORDS = 300


def answer_words(text: str) -> int:
    return len("\n".join(line for line in text.splitlines()
                         if not line.lstrip().startswith(("|", "![", "*Setting:"))).split())


def retaken_results(tmp: Path) -> Path:
    """The committed results as a quiet re-take leaves them: every file of the CPU machine that records
    no load, or other jobs at the profile's limit (0.25) or more, given a quiet record (other jobs'
    runnable threads 0.03), nothing else changed."""
    import shutil

    root = tmp / "results"
    shutil.copytree(RESULTS_ROOT, root)
    quiet = {"before": 0.1, "after": 1.9, "cores": 2, "processes": 2, "others": 0.03}
    for path in sorted((root / "cpu2-intel-xeon-processor").rglob("*.json")):
        data = json.loads(path.read_text())
        load = data.get("environment", {}).get("load") if isinstance(data.get("environment"), dict) else {}
        if load is None or (load or {}).get("others", 0) >= 0.25:
            data["environment"]["load"] = quiet
            path.write_text(json.dumps(data))
    return root


@pytest.fixture(scope="module")
def retaken(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("retaken")
    return render_writeup(retaken_results(root), root / "out").readme.read_text()


@pytest.mark.parametrize("which", ["committed", "retaken"])
def test_every_answer_keeps_within_300_words(retaken, which):
    readme = retaken if which == "retaken" else (REPO / "writeup" / "README.md").read_text()
    for problem, text in answers(readme).items():
        assert answer_words(text) <= ANSWER_TOTAL_WORDS, f"{problem}: {answer_words(text)} words"


def test_after_a_quiet_retake_every_yes_no_question_has_its_verdict(retaken):
    found = answers(retaken)
    assert "no verdict" not in retaken.lower() and "not evidence" not in "".join(found.values())
    assert re.search(r"Matched: \*\*(yes|no)\*\*", found["ddp_bucketed_benchmarking"])
    assert re.search(r"\*\*\(b\)\*\* \*\*(Yes|No|Partly)\*\*: .* \(95% interval ", found["fsdp_accounting"])
    assert re.search(r"\*\*\(a\)\*\* \*\*(Yes|No)\*\*", found["optimizer_state_sharding_accounting"])
    assert "(95% interval " in found["optimizer_state_sharding_accounting"].split("**(b)**")[1]
