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


def _write_results_tree(root, backward_s: float | None):
    """One machine: an all-reduce line exactly on o + x / w (2 ranks, gloo, CPU), a step run with
    a two-size bucket sweep whose buckets are planted, and (optionally) a profile of its workload."""
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
    line = [measured_record(GridPoint("gloo", "cpu", 2, p, 5, 5), [t * f for f in (0.99, 1.0, 1.01)], warmup_iters=5,
                            correct=True, shared_gpu=False, threads_per_rank=1)
            for p, t in ((p, SECTION_O + p / SECTION_W) for p in (2**16, 2**20, 2**24))]
    write_results(results_path("allreduce", tag, root=root), ResultsFile("allreduce", env, {"iters": 3}, line))
    setting = StepSetting(model_size="tiny", context_length=32, global_batch=4, bucket_sizes_mb=(0.5, 100.0),
                          rounds=6, steps_per_round=1, variants=(COMPUTE_ONLY, "bucketed-0.5MB", "bucketed-100MB"))
    raw = [dict(variant=COMPUTE_ONLY, step_times_s=[0.5] * 6)]
    for name, buckets in SECTION_BUCKETS.items():
        raw.append(dict(variant=name, step_times_s=[0.5 + SECTION_EXPOSED[name]] * 6,
                        sync_times_s=[SECTION_WAIT[name]] * 6, allreduce_calls_per_step=len(buckets),
                        n_buckets=len(buckets), bucket_bytes=buckets))
    write_results(results_path("ddp_step", tag, root=root),
                  ResultsFile("ddp_step", env, to_json(setting), records_from_measured(raw, setting.tokens_per_step),
                              {"n_parameters": SECTION_PARAMETERS, "threads_per_rank": 1}))
    if backward_s is not None:
        us = backward_s * 1e6
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


def _render_section(tmp_path, backward_s):
    from cs336_systems.writeup.context import RenderContext
    from cs336_systems.writeup.load import load_results
    from cs336_systems.writeup.overhead_section import overhead_model_section

    root = _write_results_tree(tmp_path / "results", backward_s)
    return overhead_model_section(RenderContext(load_results(root), tmp_path / "out")).markdown


def test_the_section_predicts_each_size_from_its_buckets_and_the_profiled_backward(tmp_path):
    backward = 0.200  # far longer than the channel needs: compute-bound
    text = _render_section(tmp_path, backward)
    for name, buckets in SECTION_BUCKETS.items():
        # By hand: every bucket finds the channel free, so only the last one's transfer shows.
        expected = SECTION_O + buckets[-1] / SECTION_W
        assert simulate_in_time_steps(buckets, backward, SECTION_W, SECTION_O, 1e-5) == pytest.approx(expected, abs=3e-5)
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert float(cells[5]) == pytest.approx(expected * 1e3, rel=5e-3)  # predicted wait after backward (ms)
        assert float(cells[7].rstrip("×")) == pytest.approx(expected / SECTION_WAIT[name], rel=5e-3)
    assert "**Compute-bound here**: backward computes for 200 ms" in text
    # Iterations 1% either side of the line: the bootstrap interval holds o and stays within 2% of it.
    low, high = map(float, re.search(r"\$o\$ = 2000 µs \(95% interval (\S+) to (\S+) µs\)", text).groups())
    assert 1960 <= low <= 2000 <= high <= 2040
    assert "That accounts for all of the gap: the measured point lies on the line." in text
    assert "| gloo | cpu | 2 | 0.0625, 1, 16 | 2000 |" in text and "| 1.000 |" in text  # relative R² of a line
    # 0.5 MB: 3 ms predicted against 4 ms measured (0.75×, inside); 100 MB: 6 against 10 ms (0.6×, outside).
    assert "Predicted / measured wait after backward runs from 0.600× to 0.750×: outside ±30% at 100 MB (0.600×)." in text
    # Nothing hidden: n_b o + s / w = 4 x 2 + 4 = 12 ms against 10 ms measured, and 2 + 4 = 6 against 12 ms.
    assert ("Channel busy time / measured exposed overhead runs from 0.500× to 1.20×: outside ±30% at 100 MB "
            "(0.500×).") in text
    assert "Here 2 ranks × 1 compute thread fill the 2 cores" in text  # the planted environment and notes
    assert ("backward computing for 200 ms with nothing beside it (naive DDP) and for 300 ms beside per-parameter "
            "DDP's all-reduces (1.50×), 100 ms lost") in text
    assert "Communication-bound regime" in text and "**not measured here**; `make bench-gpu`" in text


def test_without_a_profile_the_recursion_says_what_is_missing(tmp_path):
    text = _render_section(tmp_path, None)
    assert "no profile of this workload on this machine" in text and "**not measured here**; `make bench`" in text
    assert "| bucketed-100MB | 100 | 1 |" in text  # the closed form is still shown
