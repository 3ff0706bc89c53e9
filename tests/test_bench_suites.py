"""The make-bench suites: every step names a script that exists, writes where the writeup
reads, and the GPU suite refuses to run without a GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cs336_systems.bench.suites import cited_files, cpu_suite, gpu_suite, quick_suite, retake_reason, retake_suite
from cs336_systems.results.environment import Load
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.host import Host
from cs336_systems.results.kinds import read_any

from .test_writeup_allreduce import environment, record

pytestmark = pytest.mark.problem("beyond")
REPO = Path(__file__).resolve().parents[1]
OUT = Path("OUT")
RESULT_FILES = {"allreduce.json", "naive_ddp.json", "ddp_step.json", "ddp_step-ablation.json",
                "profile/profile.json", "sharded_optimizer.json", "fsdp_step.json", "bucket_family.json",
                "ffn_bytes.json", "fsdp_options.json", "lightning_claims.json", "answers_step.json"}
MODULE_FILES = ("fsdp_modules.json", "fsdp_modules-ws3.json")  # the CPU suites'


def _arg(step, flag: str) -> str:
    return step.args[step.args.index(flag) + 1]


@pytest.mark.parametrize("suite", [cpu_suite, quick_suite, lambda out: gpu_suite(out, 2), lambda out: gpu_suite(out, 1)])
def test_steps_run_existing_scripts_into_the_results_folder(suite):
    steps = suite(OUT)
    for step in steps:
        assert (REPO / step.script).is_file(), step.script
        assert step.command[-2:] == ["--out", step.out]
    outputs = {Path(s.out).relative_to(OUT).as_posix() for s in steps}
    # the GPU suite does not time the answers (the CPU suites do)
    assert outputs - {"ddp_step-nccl1.json", "fsdp_options-ws4.json", *MODULE_FILES} == RESULT_FILES - (
        set() if "answers_step.json" in outputs else {"answers_step.json"})


@pytest.mark.parametrize("suite", [cpu_suite, quick_suite])
def test_cpu_suites_run_the_modules_benchmark_at_2_and_3_ranks(suite):
    """Issue 41: our fully_shard beside torch's on the six models, at 2 and 3 gloo ranks."""
    steps = [s for s in suite(OUT) if s.script == "scripts/bench_fsdp_modules.py"]
    assert {Path(s.out).name: _arg(s, "--world-size") for s in steps} == dict(zip(MODULE_FILES, ("2", "3")))


def test_gpu_suite_uses_nccl_only_with_a_gpu_per_rank():
    two = " ".join(a for s in gpu_suite(OUT, 2) for a in s.args)
    assert "nccl" in two and "--world-sizes 2 " in two and "xl" in two
    *shared, rehearsal = gpu_suite(OUT, 1)
    one = " ".join(a for s in shared for a in s.args)
    assert "nccl" not in one and "--backend gloo" in one
    # One GPU rehearses the multi-GPU DDP runs: NCCL at world size 1, xl, torch's DDP beside.
    assert (_arg(rehearsal, "--backend"), _arg(rehearsal, "--world-size"), _arg(rehearsal, "--model-size")) == (
        "nccl", "1", "xl")
    assert "--no-torch-ddp" not in rehearsal.args and rehearsal.out.endswith("ddp_step-nccl1.json")
    # xl's wrappers take turns in GPU memory; the CPU model's all stay built.
    assert two.count("--rebuild-each-round") == 2 and "--rebuild-each-round" not in " ".join(
        a for s in cpu_suite(OUT) for a in s.args)
    six = [s for s in gpu_suite(OUT, 6) if s.name == "all-reduce grid"][0]
    assert six.args[six.args.index("--world-sizes") + 1 : six.args.index("--world-sizes") + 4] == ("2", "4", "6")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        gpu_suite(OUT, 0)


def test_profile_and_step_benchmark_train_the_same_batch():
    """The timelines explain the step benchmark's numbers only if they ran the same workload."""
    for steps in (cpu_suite(OUT), gpu_suite(OUT, 1), gpu_suite(OUT, 2)):
        by_name = {s.name: s for s in steps}
        step, profile = by_name["DDP step benchmark"], by_name["profiler timelines"]
        for flag in ("--model-size", "--context-length", "--global-batch"):
            assert _arg(step, flag) == _arg(profile, flag), flag


def test_the_retake_suite_runs_exactly_the_cited_files_that_are_not_quiet_evidence(tmp_path):
    """make bench-retake: a file the pages cite with no load record, one over its own, one with no
    host record (steal, calibration), one not quiet, or one missing is taken again; a quiet one,
    or one no page cites, is left alone."""
    folder, pages = tmp_path / "cpu2-x", tmp_path / "writeup"
    quiet_host = Host(0.0, 0.0, 2e-3, 2e-3, 0.04, 1.1, quiet=True)
    quiet_env = dataclasses.replace(environment(), host=quiet_host)
    noisy_env = dataclasses.replace(quiet_env, host=dataclasses.replace(quiet_host, quiet=False, reasons=["wide"]))
    loaded = dataclasses.replace(quiet_env, load=Load(before=9.0, after=9.0, cores=2, processes=2, others=3.0))
    planted = {"allreduce.json": dataclasses.replace(quiet_env, load=None), "ddp_step.json": loaded,
               "fsdp_step.json": quiet_env, "naive_ddp.json": environment(), "sharded_optimizer.json": noisy_env,
               "bucket_family.json": dataclasses.replace(quiet_env, load=None)}
    for name, env in planted.items():
        write_results(folder / name, ResultsFile("allreduce", env, {}, [record("gloo", "cpu", 2, 1024, [1e-3] * 3)]))
    (pages / "details").mkdir(parents=True)
    cited = [*planted.keys() - {"bucket_family.json"}, "fsdp_options.json"]  # fsdp_options: missing
    (pages / "README.md").write_text("".join(f"from `cpu2-x/{name}`.\n" for name in cited[:3]))
    (pages / "details" / "a.md").write_text("".join(f"*from `cpu2-x/{name}`*\n" for name in cited[3:]))
    assert cited_files(folder, pages) == set(cited)
    retaken = {Path(s.out).name for s in retake_suite(folder, pages)}
    assert retaken == {"allreduce.json", "ddp_step.json", "naive_ddp.json", "sharded_optimizer.json",
                       "fsdp_options.json"}
    assert retake_reason(folder / "naive_ddp.json") == "no steal or calibration record"
    assert retake_reason(folder / "sharded_optimizer.json") == "not quiet: wide"


def test_the_cpu_grid_keeps_its_1000_mb_cells_at_6_ranks_on_a_24_gb_machine():
    """The grid's 1000 MB at 4 and 6 ranks: the guard counts 3 payloads a rank (17.6 GiB at 6 ranks)
    against what is available once the ranks have started (19.8 GiB measured on the 24 GB 2-core
    machine); the suite lets it use all of that, since gloo's ring needs less (9.7 GiB measured)."""
    from cs336_systems.bench.allreduce.plan import memory_skip_reason
    from cs336_systems.units import GB, MB

    grid = next(s for s in cpu_suite(OUT) if s.out.endswith("/allreduce.json"))
    assert _arg(grid, "--world-sizes") == "2" and "6" in grid.args and "1000" in grid.args
    fraction = float(_arg(grid, "--memory-fraction"))
    for ranks in (4, 6):
        assert memory_skip_reason(1000 * MB, ranks, int(19.8 * GB), fraction) is None


def test_a_retake_of_the_committed_cpu_folder_covers_every_cited_file_that_is_not_quiet():
    """What `make bench-retake` reruns on the 2-core Intel machine: every cpu-suite file of its folder
    that the committed pages cite and that is not quiet evidence, the profile among them while it
    was taken with other jobs at 0.25 or more."""
    folder = REPO / "writeup" / "results" / "cpu2-intel-xeon-processor"
    retaken = {Path(s.out).relative_to(folder).as_posix() for s in retake_suite(folder)}
    cited = cited_files(folder)
    assert {"allreduce.json", "ddp_step.json", "fsdp_step.json", "profile/profile.json"} <= cited
    for step in cpu_suite(folder):
        name = Path(step.out).relative_to(folder).as_posix()
        assert (name in retaken) == (name in cited and retake_reason(Path(step.out)) is not None), name
    profile = read_any(folder / "profile" / "profile.json").environment.load
    if profile.others >= 0.25:
        assert "profile/profile.json" in retaken


@pytest.mark.parametrize("suite", [cpu_suite, lambda out: gpu_suite(out, 2)])
def test_the_bucket_sweep_sizes_build_distinct_layouts(suite):
    """Issue 59: on cpu-small the library's 1 MB first bucket made 100 and 1000 MB the same two
    buckets, so the sweep timed one layout twice. Every size of each suite's sweep must build a
    layout of its own, as BucketedDDP plans it for the suite's model (on the meta device)."""
    import torch

    from cs336_basics.model import TransformerLM, model_config
    from cs336_systems.bench.step.variants import planned_layouts

    step = next(s for s in suite(OUT) if s.name == "DDP step benchmark")
    sizes = tuple(float(x) for x in step.args[step.args.index("--bucket-sizes-mb") + 1:][:4])
    with torch.device("meta"):
        model = TransformerLM(model_config(_arg(step, "--model-size"), int(_arg(step, "--context-length"))))
    layouts = planned_layouts(model, sizes)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(sum(layout) == total for layout in layouts.values())
    assert len({tuple(layout) for layout in layouts.values()}) == len(sizes), layouts
