"""The make-bench suites: every step names a script that exists, writes where the writeup
reads, and the GPU suite refuses to run without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from cs336_systems.bench_suites import cpu_suite, gpu_suite, quick_suite

pytestmark = pytest.mark.problem("beyond")
REPO = Path(__file__).resolve().parents[1]
RESULT_FILES = {"allreduce.json", "naive_ddp.json", "ddp_step.json", "ablation.json", "sharded_optimizer.json"}


@pytest.mark.parametrize("suite", [cpu_suite, quick_suite, lambda out: gpu_suite(out, 2), lambda out: gpu_suite(out, 1)])
def test_steps_run_existing_scripts_into_the_results_folder(suite):
    steps = suite("OUT")
    for step in steps:
        assert (REPO / step.script).is_file(), step.script
    outputs = {Path(a).name for s in steps for a in s.args if a.startswith("OUT/") and a.endswith(".json")}
    assert outputs - {"ddp_step_nccl1.json"} == RESULT_FILES
    assert any("OUT/profile" in s.args for s in steps)


def test_gpu_suite_uses_nccl_only_with_a_gpu_per_rank():
    two = " ".join(a for s in gpu_suite("OUT", 2) for a in s.args)
    assert "nccl" in two and "--world-sizes 2 " in two and "xl" in two
    *shared, rehearsal = gpu_suite("OUT", 1)
    one = " ".join(a for s in shared for a in s.args)
    assert "nccl" not in one and "--shared-gpu" in one
    # One GPU rehearses the multi-GPU DDP runs: NCCL at world size 1, xl, torch's DDP beside.
    assert rehearsal.args[rehearsal.args.index("--backend") + 1] == "nccl"
    assert rehearsal.args[rehearsal.args.index("--world-size") + 1] == "1"
    assert rehearsal.args[rehearsal.args.index("--model-size") + 1] == "xl"
    assert "--no-torch-ddp" not in rehearsal.args and rehearsal.args[-1].endswith("ddp_step_nccl1.json")
    # xl's wrappers take turns in GPU memory; the CPU model's all stay built.
    assert two.count("--rebuild-each-round") == 2 and "--rebuild-each-round" not in " ".join(
        a for s in cpu_suite("OUT") for a in s.args)
    six = [s for s in gpu_suite("OUT", 6) if s.name == "all-reduce grid"][0]
    assert six.args[six.args.index("--world-sizes") + 1 : six.args.index("--world-sizes") + 4] == ("2", "4", "6")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        gpu_suite("OUT", 0)
