"""The writeup's all-reduce page and answer (and naive DDP's check), from small results files
written with the benchmarks' own writers.

Each test plants times whose reading is known (a line o + bytes/w, more ranks than cores, gloo
ranks sharing a GPU, a wrong sum) and checks the numbers the rendered page and answer draw from
them. Nothing spawns a process.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cs336_systems.bench.allreduce import AllReduceRecord, GridPoint, measured_record, skipped_record
from cs336_systems.results.environment import Environment, Load
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.paths import results_path
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.allreduce_analysis import comm_groups, fit_group, ranks_per_core, time_sharing_bound
from cs336_systems.writeup.allreduce_section import allreduce_page
from cs336_systems.writeup.naive_ddp_section import naive_ddp_page
from cs336_systems.writeup.pages import machines_page

pytestmark = pytest.mark.problem("distributed_communication_single_node")

KB, MB = 2**10, 2**20
PAYLOADS = [64 * KB, MB, 16 * MB]
PLANTED_O_S, PLANTED_W = 250e-6, 2e9  # the all-reduce line: 250 µs per call, 2 GB/s
TAG = "cpu2-test-xeon"


def quiet(cores: int = 2, processes: int = 2) -> Load:
    """A load record of a quiet machine: no other job runnable during the run (its timings are evidence)."""
    return Load(before=0.2, after=1.9, cores=cores, processes=processes, others=0.0)


def environment(device_type: str = "cpu", backend: str = "gloo", world_size: int = 2, cpu_count: int = 2,
                gpu_count: int = 0, shared_gpu: bool = False, load: Load | None = None) -> Environment:
    """A planted run's environment, on a quiet machine unless ``load`` says otherwise (a file that did
    not record its load: ``dataclasses.replace(environment(), load=None)``)."""
    return Environment(
        hostname="testhost", platform="Linux-test", python_version="3.11.0", torch_version="2.99.0",
        cuda_version="12.9" if gpu_count else None, nccl_version="2.27.0" if gpu_count else None,
        cpu_model="Test Xeon Processor", cpu_count=cpu_count, gpu_name="Test GPU 80GB" if gpu_count else None,
        gpu_count=gpu_count, backend=backend, world_size=world_size, device_type=device_type, shared_gpu=shared_gpu,
        machine_tag="ignored", git_commit="abcdef0123456789abcdef0123456789abcdef01", git_dirty=False,
        timestamp_utc="2031-01-02T03:04:05+00:00", load=load or quiet(cpu_count, world_size),
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


def page_for(tmp_path: Path, runs: dict[str, tuple[list[AllReduceRecord], Environment]]) -> tuple[str, str]:
    """Write one results file per machine tag with the benchmark's writer; (details page, answer), spaces folded."""
    root = tmp_path / "results"
    for tag, (records, env) in runs.items():
        write_results(results_path(AllReduceRecord.KIND, tag, root=root),
                      ResultsFile(AllReduceRecord.KIND, env, {"iters": 5, "warmup": 5}, records))
    out = render_writeup(root, tmp_path / "out", pages=[allreduce_page])
    return " ".join(out.details[0].read_text().split()), " ".join(out.readme.read_text().split())


def share(o_s: float, t_s: float) -> str:
    """o / median as the table and answer write it: percent to 2 significant digits."""
    return f"{100 * o_s / t_s:.2g}%"


def test_table_rows_are_the_records_numbers(tmp_path):
    records = line_records("gloo", "cpu", [2, 4])
    skipped = skipped_record(GridPoint("gloo", "cpu", 4, 2**30, 5, 5), "budget: test skip", shared_gpu=False)
    md, answer = page_for(tmp_path, {TAG: (records + [skipped], environment(world_size=4))})
    t = planted_s(MB, 2)
    busbw = MB / t / 1e9  # 2 ranks: busbw = algbw
    assert (f"| gloo | cpu | 2 | 1 | 5 | {t * 1e3:.3f} | {t * 1e3:.3f}–{t * 1e3:.3f} | {busbw:.2f} | {busbw:.2f} | "
            f"{share(PLANTED_O_S, t)} | correct |") in md
    assert "| gloo | cpu | 4 | 1024 | 0 |" in md and "skipped: budget: test skip" in md
    assert "Test Xeon Processor (2 logical cores)" in md and "commit abcdef0" in md
    assert "world sizes 2, 4" in md and "5 timed iterations per payload after 5 warm-up" in md
    assert "1 torch thread per rank" in md and "All 6 measured settings reduced to the exact expected sums" in md
    assert (tmp_path / "out" / "figures" / f"{TAG}_allreduce_allreduce.png").is_file()
    assert re.search(rf"!\[[^\]]*\]\(\.\./figures/{TAG}_allreduce_allreduce\.png\)", md)
    # The answer: one row per line, one column per payload; the gap named once, with a link.
    assert f"| gloo (cpu), 2 ranks | {planted_s(64 * KB, 2) * 1e3:.3f} ms ·" in answer
    assert "NCCL on GPUs" in answer and "machines.md#not-measured-here" in answer


def test_the_answer_reads_the_per_call_cost_from_the_fit(tmp_path):
    md, answer = page_for(tmp_path, {TAG: (line_records("gloo", "cpu", [2]), environment())})
    small, large = planted_s(64 * KB, 2), planted_s(16 * MB, 2)
    # The details page reasons it out; the answer keeps two sentences of it.
    assert f"the 2-rank medians puts $o$ at {PLANTED_O_S * 1e6:.0f} µs" in md
    assert f"the fit's $o$ ({share(PLANTED_O_S, small)} of the median) describes an average call" in md
    peak = 16 * MB / large / 1e9
    assert f"At 0.0625 MB the bytes do not set the time: busbw is {64 * KB / small / 1e9:.3g} GB/s against the peak {peak:.3g} GB/s" in md
    assert (f"At 0.0625 MB the per-call cost, not the bytes, sets the time: busbw is {64 * KB / small / 1e9:.3g} GB/s "
            f"against the peak {peak:.3g} GB/s") in answer
    # Every planted call takes the median, so the fastest is no faster than o: no "average call" in the answer.
    assert f"the fastest 0.0625 MB all-reduces took {small * 1e3:.3g} ms" in md and "above $o$ itself" in md
    assert f"single calls take {small * 1e3:.3g} to" in answer and "not a floor" not in answer


@pytest.mark.parametrize("cores, crowded", [(2, ["4", "6"]), (4, ["6"]), (8, [])])
def test_more_ranks_than_cores_is_explained_from_the_core_count(tmp_path, cores, crowded):
    records = line_records("gloo", "cpu", [2, 4, 6], half_width=0.05)
    md, answer = page_for(tmp_path, {TAG: (records, environment(world_size=6, cpu_count=cores))})
    ratio = planted_s(16 * MB, 6) / planted_s(16 * MB, 2)
    assert f"2 → 6 ranks multiplies the median time by {ratio:.2f}×" in answer
    assert "grow by 1.67×" in md and "the ring's 1.67× more bytes per rank" in answer  # 2(n−1)/n: 10/6 over 1
    if not crowded:
        assert "outnumber" not in md + answer and "queued" not in answer
        return
    shares = " and ".join(f"{int(n) / cores:.3g}" for n in crowded)
    assert (f"With {' and '.join(crowded)} ranks on {cores} logical cores the ranks outnumber the cores "
            f"({shares} ranks per core)") in md
    # Were each byte's work queued for the cores: ring factor x ranks per core, 6 ranks over 2.
    bound = (2 * 5 / 6 * max(1, 6 / cores)) / (2 * 1 / 2 * max(1, 2 / cores))
    assert f"the time would grow by {bound:.2f}×" in md and f"the {bound:.2f}× of all work queued on {cores} cores" in answer


@pytest.mark.parametrize("slowdown, reading, short", [
    (1.2, "below even the ring's factor", "below even"),  # under 10/6
    (3.4, "between the two", "between"),  # the committed CPU run's 3.26× at 100 MB lies here too
    (6.0, "above both", "above both"),  # over (10/6) x 3 = 5
])
def test_time_growth_is_read_against_the_ring_and_the_shared_cores(tmp_path, slowdown, reading, short):
    records = line_records("gloo", "cpu", [2], half_width=0.05) + [
        record("gloo", "cpu", 6, p, spread(planted_s(p, 2) * slowdown, 0.05)) for p in PAYLOADS]
    md, answer = page_for(tmp_path, {TAG: (records, environment(world_size=6))})
    assert f"multiplies the median time by {slowdown:.2f}×" in answer
    assert f"the time would grow by 5.00×, so the measured growth lies {reading}" in md
    assert f"{slowdown:.2f}×, {short} the ring's 1.67× more bytes per rank and the 5.00× of all work queued" in answer


def test_gpu_rows_say_gloo_stages_through_the_host_and_ranks_share_the_gpu(tmp_path):
    gpu = line_records("nccl", "cuda", [2]) + line_records("gloo", "cuda", [4], shared=True)
    env = environment("cuda", "nccl,gloo", 4, gpu_count=2)
    md, answer = page_for(tmp_path, {TAG: (line_records("gloo", "cpu", [2]), environment()),
                                     "2xtest-gpu": (gpu, env)})
    assert "Machine `2xtest-gpu`" in md and "2× Test GPU 80GB" in md
    assert "| nccl | cuda | 2 |" in md and "| gloo | cuda (shared GPU) | 4 |" in md
    assert "not-measured-here" not in answer  # NCCL was measured: no gap left
    assert "**nccl on cuda:**" in answer and "**gloo on cuda (ranks sharing a GPU):**" in answer
    assert md.count("pinned host memory") == 1 and "take turns on 2 GPUs" in md


def test_wrong_results_are_flagged(tmp_path):
    records = line_records("gloo", "cpu", [2])
    records[1] = record("gloo", "cpu", 2, MB, spread(planted_s(MB, 2)), correct=False)
    md, _ = page_for(tmp_path, {TAG: (records, environment())})
    assert "**WRONG**" in md and "**Wrong reduced values** in gloo × 2 at 1 MB" in md
    assert "exact expected sums" not in md


def test_no_results_names_both_gaps_with_their_commands(tmp_path):
    out = render_writeup(tmp_path / "none", tmp_path / "out", pages=[allreduce_page, machines_page])
    text = out.text()
    assert "`make bench`" in text and "`make bench-gpu`" in text
    assert not out.figures and not re.search(r"\d+\.\d+ ms", text)


def test_the_naive_ddp_check_is_the_records_numbers(tmp_path):
    from .test_writeup_ddp import build_results_tree

    out = render_writeup(build_results_tree(tmp_path), tmp_path / "out", pages=[naive_ddp_page])
    answer = " ".join(out.readme.read_text().split())
    assert "parameters differ from single-process training by at most 2.20e-08, within the tolerance" in answer
    assert "| naive | 2 |" in out.details[0].read_text()


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


def test_time_sharing_helpers():
    assert ranks_per_core(6, 2) == 3 and ranks_per_core(2, 2) is None and ranks_per_core(4, None) is None
    assert time_sharing_bound(2, 6, 2) == pytest.approx(5.0)
    assert time_sharing_bound(2, 4, 8) == pytest.approx(1.5)  # enough cores: the ring's factor only
