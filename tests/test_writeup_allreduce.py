"""The writeup's all-reduce section, from small results files written with the benchmark's own writer.

Each test plants times whose reading is known (a line o + bytes/w, spreads that do or do not
overlap, more ranks than cores, gloo ranks sharing a GPU) and checks the sentence and the
numbers the section draws from them. Nothing spawns a process.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cs336_systems.bench.allreduce import AllReduceRecord, GridPoint, measured_record, skipped_record
from cs336_systems.results.environment import Environment
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import results_path
from cs336_systems.writeup.allreduce_analysis import (
    comm_groups,
    fit_group,
    levels_off_at,
    ranks_per_core,
    spreads_overlap,
    time_sharing_bound,
)
from cs336_systems.writeup.allreduce_section import allreduce_section
from cs336_systems.writeup.context import RenderContext
from cs336_systems.writeup.load import load_results

pytestmark = pytest.mark.problem("distributed_communication_single_node")

KB, MB = 2**10, 2**20
PAYLOADS = [64 * KB, MB, 16 * MB]
PLANTED_O_S, PLANTED_W = 250e-6, 2e9  # the all-reduce line: 250 µs per call, 2 GB/s
TAG = "cpu2-test-xeon"


def environment(device_type: str = "cpu", backend: str = "gloo", world_size: int = 2, cpu_count: int = 2,
                gpu_count: int = 0, shared_gpu: bool = False) -> Environment:
    return Environment(
        hostname="testhost", platform="Linux-test", python_version="3.11.0", torch_version="2.99.0",
        cuda_version="12.9" if gpu_count else None, nccl_version="2.27.0" if gpu_count else None,
        cpu_model="Test Xeon Processor", cpu_count=cpu_count, gpu_name="Test GPU 80GB" if gpu_count else None,
        gpu_count=gpu_count, backend=backend, world_size=world_size, device_type=device_type, shared_gpu=shared_gpu,
        machine_tag="ignored", git_commit="abcdef0123456789abcdef0123456789abcdef01", git_dirty=False,
        timestamp_utc="2031-01-02T03:04:05+00:00",
    )


def spread(median_s: float, half_width: float = 0.0) -> list[float]:
    """Five times with this median: p10 = median·(1 − 0.8·half_width), p90 = median·(1 + 0.8·half_width)."""
    return [median_s * (1 + f * half_width) for f in (-1, -0.5, 0, 0.5, 1)]


def record(backend: str, device: str, ws: int, payload: int, times: list[float], shared: bool = False,
           correct: bool = True) -> AllReduceRecord:
    return measured_record(GridPoint(backend, device, ws, payload, 5, 5), times, warmup_iters=5, correct=correct,
                           shared_gpu=shared, threads_per_rank=1)


def planted_s(payload: int, ws: int) -> float:
    """The planted line, slower by 10% per rank beyond 2."""
    return (PLANTED_O_S + payload / PLANTED_W) * (1 + 0.1 * (ws - 2))


def line_records(backend: str, device: str, world_sizes: list[int], shared: bool = False,
                 half_width: float = 0.0) -> list[AllReduceRecord]:
    return [record(backend, device, ws, p, spread(planted_s(p, ws), half_width), shared)
            for ws in world_sizes for p in PAYLOADS]


def section_for(tmp_path: Path, runs: dict[str, tuple[list[AllReduceRecord], Environment]]):
    """Write one results file per machine tag with the benchmark's writer, and render the section."""
    root = tmp_path / "results"
    for tag, (records, env) in runs.items():
        write_results(results_path(AllReduceRecord.KIND, tag, root=root),
                      ResultsFile(AllReduceRecord.KIND, env, {"iters": 5, "warmup": 5}, records))
    return allreduce_section(RenderContext(load_results(root), tmp_path / "out"))


def paragraph(markdown: str, start: str) -> str:
    return next(p for p in markdown.split("\n\n") if p.startswith(start))


def test_table_rows_are_the_records_numbers(tmp_path):
    records = line_records("gloo", "cpu", [2, 4])
    skipped = skipped_record(GridPoint("gloo", "cpu", 4, 2**30, 5, 5), "budget: test skip", shared_gpu=False)
    section = section_for(tmp_path, {TAG: (records + [skipped], environment(world_size=4))})
    md = section.markdown
    t = planted_s(MB, 2)
    busbw = MB / t / 1e9  # 2 ranks: busbw = algbw
    assert f"| gloo | cpu | 2 | 1 | 5 | {t * 1e3:.3f} | {t * 1e3:.3f}–{t * 1e3:.3f} |" in md
    assert f"| {busbw:.2f} | {busbw:.2f} | correct |" in md  # 3 significant digits
    assert "| gloo | cpu | 4 | 1024 | 0 |" in md and "skipped: budget: test skip" in md
    assert "Test Xeon Processor (2 logical cores)" in md and "commit abcdef0" in md
    assert "world sizes 2, 4" in md and "5 timed iterations asked per payload after 5 warm-up" in md
    assert "1 torch thread per rank" in md and "All 6 measured settings reduced to the exact expected sums" in md
    assert len(section.figures) == 1 and section.figures[0].is_file()
    assert re.search(rf"!\[[^\]]*\]\(\.\./figures/{TAG}_allreduce_allreduce\.png\)", md)
    assert "NCCL on GPUs" in md and "`make bench-gpu`" in md  # no GPU file: the gap is named


@pytest.mark.parametrize("cores, crowded", [(2, ["4", "6"]), (4, ["6"]), (8, [])])
def test_more_ranks_than_cores_is_explained_from_the_core_count(tmp_path, cores, crowded):
    records = line_records("gloo", "cpu", [2, 4, 6], half_width=0.05)
    md = section_for(tmp_path, {TAG: (records, environment(world_size=6, cpu_count=cores))}).markdown
    text = paragraph(md, "For gloo on cpu")
    ratio = planted_s(16 * MB, 6) / planted_s(16 * MB, 2)
    assert f"going from 2 to 6 ranks multiplies the median time by {ratio:.2f}×" in text
    assert "grow by 1.67×" in text  # the ring's 2(n−1)/n: 10/6 over 1
    if not crowded:
        assert "outnumber" not in text and "queued" not in text
        return
    shares = " and ".join(f"{int(n) / cores:.3g}" for n in crowded)
    assert (f"With {' and '.join(crowded)} ranks on {cores} logical cores the ranks outnumber the cores "
            f"({shares} ranks per core)") in text
    # Were each byte's work queued for the cores: ring factor x ranks per core, 6 ranks over 2.
    bound = (2 * 5 / 6 * max(1, 6 / cores)) / (2 * 1 / 2 * max(1, 2 / cores))
    assert f"the time would grow by {bound:.2f}×" in text


@pytest.mark.parametrize("slowdown, reading", [
    (1.2, "is below even the ring's factor"),  # under 10/6
    (3.4, "lies between the two"),  # the committed CPU run's 3.40× at 100 MB
    (6.0, "exceeds both"),  # over (10/6) x 3 = 5
])
def test_time_growth_is_read_against_the_ring_and_the_shared_cores(tmp_path, slowdown, reading):
    records = line_records("gloo", "cpu", [2], half_width=0.05) + [
        record("gloo", "cpu", 6, p, spread(planted_s(p, 2) * slowdown, 0.05)) for p in PAYLOADS]
    text = paragraph(section_for(tmp_path, {TAG: (records, environment(world_size=6))}).markdown, "For gloo on cpu")
    assert "the time would grow by 5.00×" in text and f"the measured {slowdown:.2f}× {reading}" in text


def test_medians_inside_each_others_spread_are_indistinguishable(tmp_path):
    # 2 and 6 ranks 10% apart with ±40% spreads: the p10–p90 ranges overlap at every payload.
    records = line_records("gloo", "cpu", [2], half_width=0.5) + [
        record("gloo", "cpu", 6, p, spread(planted_s(p, 2) * 1.1, 0.5)) for p in PAYLOADS]
    text = paragraph(section_for(tmp_path, {TAG: (records, environment(world_size=6))}).markdown, "For gloo on cpu")
    assert "going from 2 to 6 ranks leaves the time indistinguishable here" in text
    assert "multiplies the median time" not in text


def test_bandwidth_levels_off_where_the_spreads_meet_the_peak(tmp_path):
    # 1 and 16 MB at the same 1 GB/s (±4% spreads overlap); 64 KB far below it.
    times = {64 * KB: 1e-3, MB: MB / 1e9, 16 * MB: 16 * MB / 1e9}
    rising = [record("gloo", "cpu", 4, p, spread(planted_s(p, 4))) for p in PAYLOADS]
    flat = [record("gloo", "cpu", 2, p, spread(t, 0.05)) for p, t in times.items()]
    text = paragraph(section_for(tmp_path, {TAG: (flat + rising, environment(world_size=4))}).markdown, "For gloo")
    assert "indistinguishable here from its line's peak (the busbw ranges overlap) from 1 MB with 2 ranks on" in text
    assert "With 4 ranks busbw is still rising at the largest payload measured" in text


def test_gpu_rows_say_gloo_stages_through_the_host_and_ranks_share_the_gpu(tmp_path):
    gpu = line_records("nccl", "cuda", [2]) + line_records("gloo", "cuda", [4], shared=True)
    env = environment("cuda", "nccl,gloo", 4, gpu_count=2)
    md = section_for(tmp_path, {TAG: (line_records("gloo", "cpu", [2]), environment()),
                                "2xtest-gpu": (gpu, env)}).markdown
    assert "Machine `2xtest-gpu`" in md and "2× Test GPU 80GB" in md
    assert "| nccl | cuda | 2 |" in md and "| gloo | cuda (gloo ranks sharing one GPU) | 4 |" in md
    assert "rows marked so: gloo ranks sharing one GPU" in md
    assert "make bench-gpu" not in md  # NCCL was measured: no gap left
    shared = paragraph(md, "For gloo on cuda (gloo ranks sharing one GPU)")
    assert "pinned host memory" in shared and "bound by the host" in shared
    assert "The 4 ranks of these lines take turns on 2 GPUs" in shared
    assert "host" not in paragraph(md, "For nccl on cuda") and "take turns" not in paragraph(md, "For nccl on cuda")
    assert "host" not in paragraph(md, "For gloo on cpu")


def test_wrong_results_are_flagged(tmp_path):
    records = line_records("gloo", "cpu", [2])
    records[1] = record("gloo", "cpu", 2, MB, spread(planted_s(MB, 2)), correct=False)
    md = section_for(tmp_path, {TAG: (records, environment())}).markdown
    assert "**WRONG**" in md and "**Wrong reduced values** in gloo × 2 at 1 MB" in md
    assert "exact expected sums" not in md


def test_no_results_names_both_gaps_with_their_commands(tmp_path):
    section = allreduce_section(RenderContext(load_results(tmp_path / "none"), tmp_path / "out"))
    assert "`make bench`" in section.markdown and "`make bench-gpu`" in section.markdown
    assert not section.figures and not re.search(r"\d+\.\d+ ms", section.markdown)


# ---------------------------------------------------------------------------------------------
# The analysis the section (and the overhead model's) reads


def test_groups_hold_measured_records_by_line_and_payload():
    records = line_records("gloo", "cpu", [4, 2])[::-1]
    records.append(skipped_record(GridPoint("gloo", "cpu", 2, 2**30, 5, 5), "memory: test", shared_gpu=False))
    groups = comm_groups(records)
    assert [(g.backend, g.world_size) for g in groups] == [("gloo", 2), ("gloo", 4)]
    assert all([r.payload_bytes for r in rs] == PAYLOADS for rs in groups.values())


def test_fit_recovers_the_planted_line():
    fit = fit_group(line_records("gloo", "cpu", [2]))
    assert fit.o_s == pytest.approx(PLANTED_O_S) and fit.w_bytes_per_s == pytest.approx(PLANTED_W)
    assert fit.r2 == pytest.approx(1.0) and fit.n_points == 3
    assert "two distinct payload sizes" in fit_group(line_records("gloo", "cpu", [2])[:1])


def test_noise_and_time_sharing_helpers():
    a, b = record("gloo", "cpu", 2, MB, spread(1.0, 0.5)), record("gloo", "cpu", 2, MB, spread(1.5, 0.5))
    c = record("gloo", "cpu", 2, MB, spread(3.0, 0.1))
    assert spreads_overlap(a, b) and spreads_overlap(b, a) and not spreads_overlap(a, c)
    peak, first = levels_off_at([a, c])
    assert peak is a and first is a  # c is slower: a (the same bytes, less time) is the peak
    assert ranks_per_core(6, 2) == 3 and ranks_per_core(2, 2) is None and ranks_per_core(4, None) is None
    assert time_sharing_bound(2, 6, 2) == pytest.approx(5.0)
    assert time_sharing_bound(2, 4, 8) == pytest.approx(1.5)  # enough cores: the ring's factor only
