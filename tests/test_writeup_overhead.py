"""Problem 6b's section, rendered from results files written with the benchmarks' own writers.

One machine holds an all-reduce line exactly on ``o + x / w`` (iterations 1% either side), a
step run whose bucketed variants carry planted bucket payloads, waits and exposed overheads,
and (or not) a profile of the same workload with a known backward. The predictions in the
table are recomputed here by hand and by the time-stepped channel of test_overhead_model.py.
"""

from __future__ import annotations

import re

import pytest

from tests.test_overhead_model import simulate_in_time_steps

pytestmark = pytest.mark.problem("ddp_bucketed_benchmarking")


def _write_results_tree(root, backward_s: float | None, scale: float = 1.0):
    """One machine: an all-reduce line exactly on o + x / w (2 ranks, gloo, CPU), a step run with
    a two-size bucket sweep whose buckets are planted, and (optionally) a profile of its workload.
    Every time is multiplied by ``scale`` (1 + 1e-12: noise in the last bits, as another CPU gives)."""
    from cs336_systems.bench.allreduce.record import measured_record
    from cs336_systems.bench.allreduce.setting import GridPoint
    from cs336_systems.bench.profile import ProfileRecord, ProfileSetting, StepTimeline
    from cs336_systems.bench.step import COMPUTE_ONLY, StepSetting
    from tests.step_records import records_from_measured
    from cs336_systems.results.files import ResultsFile, write_results
    from cs336_systems.results.paths import PROFILE_DIR, results_dir, results_path
    from cs336_systems.results.schema import to_json
    from tests.test_writeup_allreduce import environment

    tag = "cpu2-test-model"
    env = environment()
    line = [measured_record(GridPoint("gloo", "cpu", 2, p, 5, 5), [t * f * scale for f in (0.99, 1.0, 1.01)], warmup_iters=5,
                            correct=True, shared_gpu=False, threads_per_rank=1)
            for p, t in ((p, SECTION_O + p / SECTION_W) for p in (2**16, 2**20, 2**24))]
    write_results(results_path("allreduce", tag, root=root), ResultsFile("allreduce", env, {"iters": 3}, line))
    setting = StepSetting(model_size="tiny", context_length=32, global_batch=4, bucket_sizes_mb=(0.5, 100.0),
                          rounds=6, steps_per_round=1, variants=(COMPUTE_ONLY, "bucketed-0.5MB", "bucketed-100MB"))
    raw = [dict(variant=COMPUTE_ONLY, step_times_s=[0.5 * scale] * 6)]
    for name, buckets in SECTION_BUCKETS.items():
        raw.append(dict(variant=name, step_times_s=[(0.5 + SECTION_EXPOSED[name]) * scale] * 6,
                        sync_times_s=[SECTION_WAIT[name] * scale] * 6, allreduce_calls_per_step=len(buckets),
                        n_buckets=len(buckets), bucket_bytes=buckets))
    write_results(results_path("ddp_step", tag, root=root),
                  ResultsFile("ddp_step", env, to_json(setting), records_from_measured(raw, setting.tokens_per_step),
                              {"n_parameters": SECTION_PARAMETERS, "threads_per_rank": 1}))
    if backward_s is not None:
        us = backward_s * 1e6 * scale
        def timeline(backward_us: float) -> StepTimeline:
            phases = {"forward": (0.0, 1e5), "backward": (1e5, 1e5 + backward_us)}
            return StepTimeline(2e5 + backward_us, phases, [], [], 0, False, "gloo")
        records = [ProfileRecord.from_timelines("naive", "trace_naive.json", [timeline(us), timeline(us)]),
                   ProfileRecord.from_timelines("per-parameter", "trace_pp.json", [timeline(1.5 * us)])]
        profile = ProfileSetting(model_size="tiny", context_length=32, global_batch=4)
        write_results(results_dir(tag, root) / PROFILE_DIR / "profile.json",
                      ResultsFile("profile", env, to_json(profile), records))
    return root


SECTION_O, SECTION_W = 2e-3, 1e9
SECTION_PARAMETERS = 1_000_000  # s = 4 MB
SECTION_BUCKETS = {"bucketed-0.5MB": [1_000_000, 1_000_000, 1_000_000, 1_000_000], "bucketed-100MB": [4_000_000]}
SECTION_EXPOSED = {"bucketed-0.5MB": 0.010, "bucketed-100MB": 0.012}
SECTION_WAIT = {"bucketed-0.5MB": 0.004, "bucketed-100MB": 0.010}


def _render(tmp_path, backward_s, scale: float = 1.0, out: str = "out"):
    from cs336_systems.writeup import render_writeup
    from cs336_systems.writeup.overhead_section import overhead_page

    root = _write_results_tree(tmp_path / out / "results", backward_s, scale)
    return render_writeup(root, tmp_path / out / "writeup", pages=[overhead_page])


def _row(text: str, name: str) -> list[str]:
    row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
    return [c.strip() for c in row.split("|")[1:-1]]


def test_the_page_predicts_each_size_from_its_buckets_and_the_profiled_backward(tmp_path):
    backward = 0.200  # far longer than the channel needs: compute-bound
    text = _render(tmp_path, backward).text()
    for name, buckets in SECTION_BUCKETS.items():
        # By hand: every bucket finds the channel free, so only the last one's transfer shows.
        expected = SECTION_O + buckets[-1] / SECTION_W
        assert simulate_in_time_steps(buckets, backward, SECTION_W, SECTION_O, 1e-5) == pytest.approx(expected, abs=3e-5)
        cells = _row(text, name)
        assert int(cells[1]) == len(buckets)
        closed = SECTION_O * len(buckets) + 4e6 / (SECTION_W * len(buckets))
        assert float(cells[2]) == pytest.approx(closed * 1e3, rel=5e-3)  # the closed form at the buckets built
        assert float(cells[3]) == pytest.approx(expected * 1e3, rel=5e-3)  # predicted wait after backward (ms)
        assert float(cells[4]) == pytest.approx(SECTION_WAIT[name] * 1e3, rel=5e-3)
        assert float(cells[6].split()[0]) == pytest.approx(SECTION_EXPOSED[name] * 1e3, rel=5e-3)
        assert len(cells) == 7  # the reader's columns only
    assert "**Compute-bound here**: backward (200 ms)" in text
    # Iterations 1% either side of the line: the bootstrap interval holds o and stays within 2% of it.
    low, high = map(float, re.search(r"\$o\$ = 2000 µs \(95% interval (\S+) to (\S+) µs\)", text).groups())
    assert 1960 <= low <= 2000 <= high <= 2040
    assert "| gloo (cpu), 2 ranks | 0.0625, 1, 16 | 2000 (" in text and "| 1.000 |" in text  # relative R² of a line
    assert "On 1 line (gloo (cpu), 2 ranks) the fitted $w$ lies above every algbw" in text  # a line with o > 0
    # 0.5 MB: 3 ms predicted against 4 ms measured (0.75×, inside); 100 MB: 6 against 10 ms (0.6×, outside).
    assert "runs from 0.600× to 0.750×: outside ±30% at 100 MB (0.600×)" in text
    # Nothing hidden: n_b o + s / w = 4 x 2 + 4 = 12 ms against 10 ms measured, and 2 + 4 = 6 against 12 ms.
    assert "runs from 0.500× to 1.20×: outside ±30% at 100 MB (0.500×)" in text
    assert "Here 2 ranks × 1 compute thread fill the 2 cores" in text  # the planted environment and notes
    assert "137" not in text and "200 ms with nothing beside it (naive DDP) and 300 ms beside" in text
    assert "100 ms lost" in text


def test_the_answer_gives_both_equations_and_this_machines_numbers(tmp_path):
    readme = _render(tmp_path, 0.200).readme.read_text()
    answer = readme.split("### ddp_bucketed_benchmarking", 1)[1]
    assert "T(n_b) = o\\,n_b + s/(w\\,n_b)" in answer and "\\sqrt{s\\,w\\,o}" in answer
    s = 4e6
    b_opt = (s * SECTION_W * SECTION_O) ** 0.5  # 2.83e6 bytes = 2.70 MB
    # s and b_opt in 10^6 bytes (MB, 2^20 bytes, beside) and w in 10^9 B/s: the shown values recompute to the result.
    from cs336_systems.writeup.fmt import gbps, sig
    assert (f"with $s$ = {sig(s / 1e6)}·10⁶ bytes $b_{{\\mathrm{{opt}}}}$ = **{sig(b_opt / 1e6)}·10⁶ bytes** "
            f"({b_opt / 2**20:.2f} MB)") in answer
    assert f"$w$ = {gbps(SECTION_W)}·10⁹ B/s" in answer
    assert f"$T$ = {2 * (s * SECTION_O / SECTION_W) ** 0.5 * 1e3:.3g} ms" in answer
    assert "$o$ = 2000 µs" in answer and "(details/overhead_model.md)" in answer
    assert len(answer.split()) < 250


def test_without_a_profile_the_recursion_says_what_is_missing(tmp_path):
    text = _render(tmp_path, None).text()
    assert "no profile of this workload on this machine" in text and "machines.md#not-measured-here" in text
    assert _row(text, "bucketed-100MB")[:3] == ["bucketed-100MB", "1", "6.00"]  # the closed form is still shown
    assert _row(text, "bucketed-100MB")[3] == "–"


def test_noise_in_the_last_bits_changes_neither_the_page_nor_the_figure(tmp_path):
    """Another CPU rounds the fit's least squares differently: the page and its PNG must not show it."""
    exact, noisy = _render(tmp_path, 0.200, 1.0, "a"), _render(tmp_path, 0.200, 1 + 1e-12, "b")
    assert exact.text() == noisy.text()
    assert exact.figures and [p.read_bytes() for p in exact.figures] == [p.read_bytes() for p in noisy.figures]
