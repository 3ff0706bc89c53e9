"""Problem 5b: profiler timelines show per-parameter DDP overlapping all-reduce with backward.

The end-to-end test runs scripts/profile_ddp.py once (tiny model, 2 gloo ranks, both variants
in one launch) and checks the files and the finding: naive DDP issues every all-reduce after
backward returns, so none of its communication may fall inside backward; per-parameter DDP
starts all-reduces from gradient hooks during backward, so some must. The extraction itself is
checked on hand-built traces whose answers are worked out by hand below.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest

from tests.scripts_runner import run_script

from cs336_systems.model import TransformerLM, model_config
from cs336_systems.ddp_profile import (
    AUTOGRAD_NODE_PREFIX,
    ENQUEUE_ALL_REDUCE,
    GLOO_ALL_REDUCE,
    extract_step_timelines,
    load_trace,
    merge_intervals,
    render_timelines,
)

pytestmark = pytest.mark.problem("ddp_overlap_individual_parameters_benchmarking")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_ddp.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TRACES = Path(__file__).resolve().parent / "fixtures" / "traces"



@pytest.mark.timeout(300)
def test_profile_shows_overlap_for_per_parameter_only(tmp_path, monkeypatch, capsys):
    status = run_script(
        monkeypatch, SCRIPT, "--model-size", "tiny", "--context-length", "32", "--world-size", "2",
        "--warmup-steps", "1", "--steps", "1", "--out-dir", str(tmp_path),
    )
    assert status == 0, capsys.readouterr().err
    assert "nsys profile" in capsys.readouterr().out
    for name in ("timeline_naive.png", "timeline_per-parameter.png", "timeline_overlap.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        height, width, _ = matplotlib.image.imread(tmp_path / name).shape
        assert height > 100 and width > 100
    records = {r["variant"]: r for r in json.loads((tmp_path / "profile.json").read_text())["records"]}
    assert set(records) == {"naive", "per-parameter"}
    for variant, r in records.items():
        # Each trace re-reads to the same finding the run reported.
        trace = load_trace(tmp_path / r["trace"])
        assert extract_step_timelines(trace, "gloo")[-1].overlap_fraction == pytest.approx(r["overlap_fraction"])
        assert r["n_comm_events"] > 1 and r["communication_s"] > 0 and r["backward_s"] > 0
    assert records["naive"]["overlap_fraction"] < 0.05
    assert records["per-parameter"]["overlap_fraction"] > records["naive"]["overlap_fraction"]
    # Same number of collectives per step: one per parameter plus the usage count.
    assert records["naive"]["n_comm_events"] == records["per-parameter"]["n_comm_events"]


def _x(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op", **args) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _annotation(name: str, ts: float, dur: float) -> dict:
    return _x(name, ts, dur, cat="user_annotation")


def _cpu_trace() -> dict:
    """Two steps starting at t=1000 and t=2000 (us). Step 1: forward 0-10, backward 10-50,
    finish 50-80, optimizer 80-90 (relative). Gloo all-reduces on worker threads 7 and 8:
    [30, 45] and [40, 60] overlap each other (union [30, 60]), plus [70, 80]."""
    events = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}}]
    for s in (1000.0, 2000.0):
        events += [
            _annotation("train_step", s, 100),
            _annotation("forward", s, 10),
            _annotation("backward", s + 10, 40),
            _annotation("finish_gradient_synchronization", s + 50, 30),
            _annotation("optimizer_step", s + 80, 10),
            _x(f"{AUTOGRAD_NODE_PREFIX} MmBackward0", s + 12, 10),
            _x("aten::mm", s + 13, 5),  # nested inside the node above: not a lane of its own
            _x(f"{AUTOGRAD_NODE_PREFIX} AccumulateGrad", s + 20, 5),
            _x("c10d::allreduce_", s + 29, 1),  # the enqueue on the calling thread: not communication
            _x(GLOO_ALL_REDUCE, s + 30, 15, tid=7, cat="user_annotation"),
            _x(GLOO_ALL_REDUCE, s + 40, 20, tid=8, cat="user_annotation"),
            _x(GLOO_ALL_REDUCE, s + 70, 10, tid=7, cat="user_annotation"),
        ]
    return {"traceEvents": events}


def test_extraction_on_a_hand_built_cpu_trace():
    steps = extract_step_timelines(_cpu_trace(), "gloo")
    assert len(steps) == 2
    t = steps[-1]
    assert t.phases == {
        "forward": (0, 10), "backward": (10, 50),
        "finish_gradient_synchronization": (50, 80), "optimizer_step": (80, 90),
    }
    assert t.backward_compute == [(12, 25)]  # nodes [12, 22] and [20, 25], merged
    assert t.communication == [(30, 60), (70, 80)]
    assert t.n_comm_events == 3 and not t.device_clock
    # Communication lasts 30 + 10 = 40 us; of it, [30, 50] (20 us) is inside backward [10, 50].
    assert t.communication_us == pytest.approx(40)
    assert t.overlap_fraction == pytest.approx(20 / 40)


def test_extraction_on_a_hand_built_gpu_trace():
    """GPU lanes: kernels launched during backward (matched by correlation id) are backward
    compute, wherever they run; NCCL all-reduce kernels are communication."""
    s = 5000.0
    events = [
        _annotation("train_step", s, 200),
        _annotation("forward", s, 10),
        _annotation("backward", s + 10, 30),  # the CPU only launches; kernels run later
        _x("backward", s + 10, 30, cat="gpu_user_annotation"),  # the GPU mirror: ignored
        _annotation("finish_gradient_synchronization", s + 40, 5),
        _annotation("optimizer_step", s + 45, 5),
        _x("cudaLaunchKernel", s + 5, 1, cat="cuda_runtime", correlation=1),  # forward's
        _x("cudaLaunchKernel", s + 15, 1, cat="cuda_runtime", correlation=2),
        _x("cudaLaunchKernel", s + 20, 1, tid=3, cat="cuda_runtime", correlation=3),  # autograd's device thread
        _x("cudaLaunchKernel", s + 25, 1, cat="cuda_runtime", correlation=4),
        _x("volta_sgemm_128x64_nn", s + 20, 30, tid=7, cat="kernel", correlation=1),
        _x("volta_sgemm_128x64_tn", s + 60, 40, tid=7, cat="kernel", correlation=2),
        _x("elementwise_kernel", s + 100, 20, tid=7, cat="kernel", correlation=3),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", s + 105, 45, tid=20, cat="kernel",
           correlation=4),
    ]
    (t,) = extract_step_timelines({"traceEvents": events}, "nccl")
    assert t.device_clock
    assert t.backward_compute == [(60, 120)]
    assert t.communication == [(105, 150)] and t.n_comm_events == 1
    # Backward runs on the GPU over [60, 120]; 15 of the all-reduce's 45 us lie inside it.
    assert t.backward_range == (60, 120)
    assert t.overlap_fraction == pytest.approx(15 / 45)


def _gloo_cuda_trace() -> dict:
    """gloo on CUDA tensors, one step at t=9000 us: backward's CPU range is [10, 40] and its
    kernels run over [30, 90] (stream 7). An all-reduce is enqueued at [20, 24] on the main
    thread, which launches the copy to the host (correlation 10, it runs [25, 35]); gloo's
    worker reduces on the host over [36, 70] (thread 30) and launches the copy back there
    (correlation 11, it runs [71, 76]). The optimizer's own copy (correlation 12) is not
    communication."""
    s = 9000.0
    return {"traceEvents": [
        _annotation("train_step", s, 200),
        _annotation("forward", s, 10),
        _annotation("backward", s + 10, 30),
        _annotation("finish_gradient_synchronization", s + 40, 40),
        _annotation("optimizer_step", s + 80, 20),
        _x("cudaLaunchKernel", s + 12, 1, cat="cuda_runtime", correlation=1),
        _x("cudaLaunchKernel", s + 15, 1, cat="cuda_runtime", correlation=2),
        _x("sm90_xmma_gemm_f32f32", s + 30, 40, tid=7, cat="kernel", correlation=1),
        _x("elementwise_kernel", s + 70, 20, tid=7, cat="kernel", correlation=2),
        _x(ENQUEUE_ALL_REDUCE, s + 20, 4),
        _x("cudaMemcpyAsync", s + 21, 1, cat="cuda_runtime", correlation=10),
        _x("Memcpy DtoH (Device -> Pinned)", s + 25, 10, tid=21, cat="gpu_memcpy", correlation=10),
        _x(GLOO_ALL_REDUCE, s + 36, 40, tid=30, cat="user_annotation"),
        _x("cudaMemcpyAsync", s + 70, 1, tid=30, cat="cuda_runtime", correlation=11),
        _x("Memcpy HtoD (Pinned -> Device)", s + 71, 5, tid=21, cat="gpu_memcpy", correlation=11),
        _x("cudaMemcpyAsync", s + 85, 1, cat="cuda_runtime", correlation=12),
        _x("Memcpy HtoD (Pageable -> Device)", s + 90, 5, tid=7, cat="gpu_memcpy", correlation=12),
    ]}


def test_extraction_on_a_hand_built_gloo_cuda_trace():
    """The communication lane follows the backend: gloo's worker and the copies it stages."""
    (t,) = extract_step_timelines(_gloo_cuda_trace(), "gloo")
    assert t.device_clock and t.backward_range == (30, 90)
    assert t.communication == [(25, 35), (36, 76)]  # copy out, host reduce (copy back inside)
    assert t.n_comm_events == 1
    # 10 + 40 = 50 us of communication, all of it inside backward's GPU span [30, 90] but
    # [25, 30]: 45 of 50.
    assert t.overlap_fraction == pytest.approx(45 / 50)
    assert "gloo worker threads and their host-device copies" in t.lanes_from
    # Read as if NCCL had run, the same trace has no communication at all: the lane must be
    # chosen by the backend, not by the device.
    (as_nccl,) = extract_step_timelines(_gloo_cuda_trace(), "nccl")
    assert as_nccl.n_comm_events == 0 and as_nccl.communication == []


@pytest.mark.parametrize("variant", ["naive", "per-parameter"])
def test_recorded_gloo_cpu_traces(variant):
    """Excerpts of real traces (2 gloo ranks on CPU, tiny model, cut down by
    tests/fixtures/traces/trim_trace.py): naive communicates after backward only,
    per-parameter partly inside it; both make one all-reduce per parameter plus the count."""
    trace = load_trace(TRACES / f"gloo_cpu_{variant}.json")
    (t,) = extract_step_timelines(trace, "gloo")
    parameters = len(list(TransformerLM(model_config("tiny")).parameters()))
    assert not t.device_clock and t.n_comm_events == parameters + 1  # + the usage count
    assert t.backward_compute and t.communication_us > 0
    if variant == "naive":
        assert t.overlap_fraction == 0.0
        assert min(a for a, _ in t.communication) >= t.phases["backward"][1]
    else:
        assert 0.0 < t.overlap_fraction < 1.0
    with pytest.raises(ValueError, match="backend must be one of"):
        extract_step_timelines(trace, "mpi")


def test_extraction_names_a_trace_without_steps():
    with pytest.raises(ValueError, match="trace has no 'train_step' ranges"):
        extract_step_timelines({"traceEvents": [_annotation("backward", 0, 1)]}, "gloo")


def test_merge_intervals():
    assert merge_intervals([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]


def test_rendering_is_byte_identical_for_the_same_timeline(tmp_path):
    timeline = extract_step_timelines(_cpu_trace(), "gloo")[-1]
    pair = [("naive", timeline), ("per-parameter", timeline)]
    first = render_timelines(pair, tmp_path / "a.png").read_bytes()
    second = render_timelines(pair, tmp_path / "b.png").read_bytes()
    assert first.startswith(PNG_SIGNATURE) and first == second
