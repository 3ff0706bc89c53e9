"""The profile page and ddp_overlap_individual_parameters_benchmarking (b), from planted ``profile.json`` files.

The planted timelines (tests/test_writeup_ddp.py's PROFILED) have a known share of all-reduce time
inside backward, computed here from the intervals; a second tree holds two profiled steps per
variant whose backward times overlap or do not, so the page must report both steps and claim a
difference only where every step shows it. Nothing spawns a process.
"""

from __future__ import annotations

import pytest

from cs336_systems.bench.profile import ProfileRecord, ProfileSetting
from cs336_systems.results.paths import PROFILE_DIR, results_dir
from cs336_systems.writeup import fmt, render_writeup
from cs336_systems.writeup.pages import machines_page
from cs336_systems.writeup.render import heading
from cs336_systems.writeup.profile_section import render_timelines
from cs336_systems.writeup.profile_section import profile_page

from .test_writeup import repeated_rows
from .test_writeup_ddp import PROFILE_ONLY_TAG, PROFILED, TAG, build_results_tree, profile_records, timeline, write

pytestmark = pytest.mark.problem("ddp_overlap_individual_parameters_benchmarking")
PROBLEM = "ddp_overlap_individual_parameters_benchmarking"


def inside_share(backward: tuple[float, float], communication: list[tuple[float, float]]) -> float:
    """Share of the (disjoint) all-reduce intervals inside backward, by hand."""
    inside = sum(max(0.0, min(b, backward[1]) - max(a, backward[0])) for a, b in communication)
    return inside / sum(b - a for a, b in communication)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("writeup-profile")
    first = render_writeup(build_results_tree(root), root / "out", pages=[profile_page])
    return {"root": root, "first": first, "readme": first.readme.read_text(),
            "page": (root / "out" / "details" / "profile.md").read_text()}


def test_the_answer_gives_the_share_inside_backward_and_the_timelines(rendered):
    answer = rendered["readme"].split(heading(PROBLEM) + "\n")[1]
    per_parameter, naive = inside_share(*PROFILED["per-parameter"]), inside_share(*PROFILED["naive"])
    assert per_parameter > 0.5 and naive == 0
    for tag in (TAG, PROFILE_ONLY_TAG):
        assert (f"On `{tag}` (gloo, 2 ranks on CPU), most of per-parameter DDP's communication overlaps backward: "
                f"{fmt.pct(per_parameter)} of its all-reduce time") in answer
        assert f"](figures/{tag}_profile_timeline_overlap.png)" in answer
    assert answer.startswith("\n**(b)**") and "](details/profile.md)" in answer
    assert len(answer.split("![")[0].split()) < 200


def test_rendering_twice_gives_the_same_bytes(rendered, tmp_path):
    again = render_writeup(build_results_tree(tmp_path), tmp_path / "out", pages=[profile_page])
    first = {p.name: p.read_bytes() for p in [*rendered["first"].figures, *rendered["first"].details]}
    assert first and first == {p.name: p.read_bytes() for p in [*again.figures, *again.details]}


def test_timelines_are_drawn_from_the_stored_intervals(rendered, tmp_path):
    figures = rendered["root"] / "out" / "figures"
    records = profile_records()
    expected = render_timelines([(r.variant, r.timeline) for r in records], tmp_path / "both.png")
    assert (figures / f"{TAG}_profile_timeline_overlap.png").read_bytes() == expected.read_bytes()
    for r in records:
        alone = render_timelines([(r.variant, r.timeline)], tmp_path / f"{r.variant}.png")
        assert (figures / f"{TAG}_profile_timeline_{r.variant}.png").read_bytes() == alone.read_bytes()
        assert f"[{r.variant}](../figures/{TAG}_profile_timeline_{r.variant}.png)" in rendered["page"]


def test_one_table_holds_every_profiled_step_of_every_machine(rendered):
    page = rendered["page"]
    for tag in (TAG, PROFILE_ONLY_TAG):
        for variant, (backward, communication) in PROFILED.items():
            union = sum(b - a for a, b in communication) * 1e-6
            row = (f"| `{tag}` | {variant} | 1 | {fmt.pct(inside_share(backward, communication))} | {fmt.ms(union)} | "
                   f"{fmt.ms((backward[1] - backward[0]) * 1e-6)} | {fmt.ms(100e-6)} | {len(communication)} |")
            assert row in page
    assert repeated_rows([rendered["readme"], page]) == []


def test_the_page_says_what_it_profiled_and_how_nsys_would(rendered):
    page = rendered["page"]
    mine = page.split(f"## Machine `{TAG}`")[1]
    assert f"the step benchmark's run (`{TAG}/ddp_step.json`)" in mine
    assert "no DDP step benchmark run" in page.split(f"## Machine `{PROFILE_ONLY_TAG}`")[1]
    assert ("nsys profile -t cuda,nvtx,osrt -o ddp_profile torchrun --nproc-per-node 2 scripts/profile_ddp.py "
            "--device cuda --model-size tiny --context-length 32 --global-batch 4") in mine
    assert "Each of the 2 ranks computed with 1 thread on" in mine


@pytest.mark.parametrize("pp_backward, claim", [((10.0, 45.0), False), ((10.0, 70.0), True)])
def test_two_steps_are_both_reported_and_a_difference_claimed_only_when_every_step_shows_it(tmp_path, pp_backward,
                                                                                              claim):
    # naive's backward 40 then 25 µs; per-parameter's 35 twice (between them) or 60 twice (above both).
    naive = [timeline((10.0, 50.0), [(55.0, 70.0)]), timeline((10.0, 35.0), [(55.0, 70.0)])]
    pp = [timeline(pp_backward, [(30.0, 40.0)])] * 2
    records = [ProfileRecord.from_timelines("naive", "n.json", naive),
               ProfileRecord.from_timelines("per-parameter", "p.json", pp)]
    results = tmp_path / "results"
    write(results_dir(TAG, results) / PROFILE_DIR / "profile.json", ProfileRecord.KIND, records,
          ProfileSetting(model_size="tiny", context_length=32, global_batch=4))
    page = render_writeup(results, tmp_path / "out", pages=[profile_page]).details[0].read_text()
    pp_ms = fmt.ms((pp_backward[1] - pp_backward[0]) * 1e-6)
    assert f"({pp_ms} and {pp_ms} ms against {fmt.ms(40e-6)} and {fmt.ms(25e-6)} ms)" in page
    assert ("was longer than naive's in each profiled step" in page) is claim
    assert ("do not say whether" in page) is not claim
    assert "That is why" not in page


def test_without_profiles_the_answer_links_the_one_gap_list(tmp_path):
    out = render_writeup(tmp_path / "none", tmp_path / "out", pages=[profile_page, machines_page])
    answer = out.readme.read_text().split(heading(PROBLEM) + "\n")[1]
    assert "No profile of both naive and per-parameter DDP" in answer
    assert "details/machines.md#not-measured-here" in answer
    machines = (tmp_path / "out" / "details" / "machines.md").read_text()
    assert machines.count("the profiler timelines of naive and per-parameter DDP") == 2  # gloo on CPU, NCCL on GPUs
