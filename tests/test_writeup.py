"""The generated writeup: built only from results files, complete, honest about gaps, reproducible.

A small results tree is written here by code, through the benchmarks' own record builders
(``make_record``, ``summarize``) so that it has their schema, with planted values whose
rendering we know: all-reduce times that lie exactly on ``o + bytes / w``, step times with a
known median. Nothing spawns a process.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import matplotlib.image
import nbformat
import numpy as np
import pytest

from cs336_systems.allreduce_benchmark import AllReduceSetting, make_record
from cs336_systems.run_metadata import write_results
from cs336_systems.writeup import render_writeup
from cs336_systems.writeup.allreduce_section import allreduce_section
from cs336_systems.writeup.sections import SECTIONS, intro_section

# One worker renders the shared tree once (the Makefile runs pytest with --dist loadgroup).
pytestmark = [pytest.mark.problem("beyond"), pytest.mark.xdist_group("writeup")]

PROBLEMS = [
    "distributed_communication_single_node",
]
CPU_TAG, GPU_TAG, SMOKE_TAG = "cpu2-test-xeon", "2xtest-gpu", "quick-smoke"
PLANTED_O_S, PLANTED_W = 250e-6, 2e9  # the all-reduce line: 250 µs per call, 2 GB/s
SMOKE_MEDIAN_S = 0.0456789  # only in the quick-smoke folder: "45.7" ms must not be rendered
TIMESTAMP = "2031-01-02T03:04:05+00:00"
PAYLOADS = [2**16, 2**20, 2**24]
COMM_SECTIONS = [intro_section, allreduce_section]  # enough for the tests about folders: two renders cost less


def environment(device_type: str, backend: str, world_size: int, gpu: bool = False) -> dict:
    """The keys ``run_metadata.collect_environment`` writes (without running git)."""
    return {
        "hostname": "testhost", "platform": "Linux-test", "python_version": "3.11.0", "torch_version": "2.99.0",
        "cuda_version": "12.9" if gpu else None, "nccl_version": "2.27.0" if gpu else None,
        "cpu_model": "Test Xeon Processor", "cpu_count": 2, "gpu_name": "Test GPU 80GB" if gpu else None,
        "gpu_count": 2 if gpu else 0, "backend": backend, "world_size": world_size, "device_type": device_type,
        "machine_tag": "ignored", "git_commit": "abcdef0123456789abcdef0123456789abcdef01", "git_dirty": False,
        "timestamp_utc": TIMESTAMP,
    }


def allreduce_records(backend: str, device: str, world_sizes: list[int], shared_gpu: bool = False,
                      scale: float = 1.0) -> list[dict]:
    records = []
    for ws in world_sizes:
        for payload in PAYLOADS:
            setting = AllReduceSetting(backend, device, ws, payload, 5, 5)
            t = scale * (PLANTED_O_S + payload / PLANTED_W) * (1 + 0.1 * (ws - 2))
            records.append(make_record(setting, shared_gpu=shared_gpu, times_s=[t] * 5, warmup_iters=5, correct=True))
    skipped = AllReduceSetting(backend, device, world_sizes[-1], 2**30, 5, 5)
    records.append(make_record(skipped, shared_gpu=shared_gpu, skip_reason="budget: test skip"))
    return records


def build_results_tree(root: Path, with_gpu: bool = False) -> Path:
    results = root / "results"
    cpu = results / CPU_TAG
    write_results(cpu / "allreduce.json", allreduce_records("gloo", "cpu", [2, 4]), environment("cpu", "gloo", 4))
    smoke = [make_record(AllReduceSetting("gloo", "cpu", 2, p, 1, 3), shared_gpu=False, times_s=[SMOKE_MEDIAN_S] * 3,
                         warmup_iters=1, correct=True) for p in PAYLOADS]
    write_results(results / SMOKE_TAG / "allreduce.json", smoke, environment("cpu", "gloo", 2))
    if with_gpu:
        gpu_records = allreduce_records("nccl", "cuda", [2], scale=0.01) + allreduce_records(
            "gloo", "cuda", [4], shared_gpu=True)
        gpu_meta = environment("cuda", "nccl,gloo", 4, gpu=True)
        write_results(results / GPU_TAG / "allreduce.json", gpu_records, gpu_meta)
    return results


def output_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("writeup")
    results = build_results_tree(root)
    first = render_writeup(results, root / "a")
    second = render_writeup(results, root / "b")
    return {"root": root, "results": results, "first": first, "second": second,
            "readme": first.readme.read_text()}


def test_rendering_twice_gives_byte_identical_files(rendered):
    a, b = output_files(rendered["root"] / "a"), output_files(rendered["root"] / "b")
    assert sorted(a) == sorted(b)
    assert {"README.md", "writeup.ipynb"} <= set(a)
    assert sum(name.startswith("figures/") for name in a) >= 5
    for name in a:
        assert a[name] == b[name], f"{name} differs between two renders of the same results"


def test_stale_figures_are_removed(rendered, tmp_path):
    stale = tmp_path / "figures" / "from-a-machine-that-is-gone.png"
    stale.parent.mkdir()
    stale.write_bytes(b"old")
    render_writeup(rendered["results"], tmp_path, sections=[intro_section])
    assert not stale.exists()


def test_every_problem_has_a_section(rendered):
    headings = [line for line in rendered["readme"].splitlines() if line.startswith("## ")]
    for problem in PROBLEMS:
        assert any(re.match(rf"## {problem}\b", h) for h in headings), f"no section for {problem}: {headings}"


def test_settings_are_named_and_no_time_of_rendering_leaks(rendered):
    readme = rendered["readme"]
    assert "Test Xeon Processor (2 logical cores)" in readme
    assert "torch 2.99.0" in readme and "commit abcdef0" in readme
    assert TIMESTAMP not in readme and "2031" not in readme


def test_unmeasured_gpu_settings_say_so_with_the_command(rendered):
    readme = rendered["readme"]
    assert "not measured here" in readme and "`make bench-gpu`" in readme
    assert "NCCL on GPUs" in readme


def test_smoke_folders_are_left_out_unless_asked_for(rendered, tmp_path):
    smoke_ms = f"{SMOKE_MEDIAN_S * 1e3:.1f}"
    assert SMOKE_TAG not in rendered["readme"] and smoke_ms not in rendered["readme"]
    included = render_writeup(rendered["results"], tmp_path / "out", include_tags=[SMOKE_TAG],
                              sections=COMM_SECTIONS).readme.read_text()
    assert f"Machine `{SMOKE_TAG}`" in included and smoke_ms in included


def test_notebook_validates_and_carries_the_readme(rendered):
    nb = nbformat.read(rendered["first"].notebook, as_version=4)
    nbformat.validate(nb)
    assert [c.id for c in nb.cells] == [f"cell-{i:04d}" for i in range(1, len(SECTIONS) + 1)]
    assert all(c.cell_type == "markdown" for c in nb.cells)
    assert "\n\n".join(c.source for c in nb.cells) + "\n" == rendered["readme"]
    assert rendered["first"].notebook.read_bytes().endswith(b"\n")


def test_figures_are_linked_relative_to_the_writeup(rendered):
    readme = rendered["readme"]
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", readme)
    assert links and all(link.startswith("figures/") for link in links)
    for link in links:
        assert (rendered["root"] / "a" / link).is_file()


def test_no_results_at_all_renders_every_gap_with_its_command(tmp_path):
    readme = render_writeup(tmp_path / "no-results", tmp_path / "out").readme.read_text()
    for problem in PROBLEMS:
        assert f"## {problem}" in readme
    assert "make bench-gpu" in readme and "`make bench`" in readme
    assert not re.search(r"\d+\.\d+ ms", readme)  # not a single measured time


def test_a_json_that_is_not_a_results_file_is_set_aside_and_named(tmp_path):
    results = build_results_tree(tmp_path)
    (results / CPU_TAG / "suite_manifest.json").write_text('["not", "records"]\n')
    readme = render_writeup(results, tmp_path / "out", sections=[intro_section]).readme.read_text()
    assert f"Set aside: {CPU_TAG}/suite_manifest.json is not a results file" in readme
    assert str(tmp_path) not in readme  # no path of the machine that rendered it
