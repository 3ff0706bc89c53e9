"""Problem 5b: profiler timelines show per-parameter DDP overlapping all-reduce with backward.

The end-to-end test runs scripts/profile_ddp.py once (tiny model, 2 gloo ranks, both variants
in one launch) and checks the files and the finding: naive DDP issues every all-reduce after
backward returns, so none of its communication may fall inside backward; per-parameter DDP
starts all-reduces from gradient hooks during backward, so some must. The extraction itself is
checked on hand-built traces whose answers are worked out by hand below.
"""

from __future__ import annotations

import shlex
import signal
from pathlib import Path

import pytest

import scripts.profile_ddp as profile_ddp
from cs336_basics.model import TransformerLM, model_config
from cs336_systems.bench.profile import (
    AUTOGRAD_NODE_PREFIX,
    ENQUEUE_ALL_REDUCE,
    GLOO_ALL_REDUCE,
    ProfileRecord,
    ProfileRun,
    ProfileSetting,
    extract_step_timelines,
    load_trace,
    merge_intervals,
    nsys_command,
)
from cs336_systems.results.environment import collect_environment
from cs336_systems.results.files import ResultsFile, write_results
from cs336_systems.results.kinds import read_any
from cs336_systems.results.schema import to_json
from cs336_systems.writeup.profile_section import render_timelines

from .script_checks import interrupted_run_writes_nothing, must_not_start, refused_in_one_line

pytestmark = pytest.mark.problem("ddp_overlap_individual_parameters_benchmarking")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TRACES = Path(__file__).resolve().parent / "fixtures" / "traces"


@pytest.mark.timeout(300)
def test_profile_shows_overlap_for_per_parameter_only(tmp_path, capsys):
    out = tmp_path / "profile" / "profile.json"
    status = profile_ddp.main(["--model-size", "tiny", "--context-length", "32", "--world-size", "2",
                               "--warmup-steps", "1", "--steps", "2", "--out", str(out)])
    assert status == 0, capsys.readouterr().err
    assert "nsys profile" in capsys.readouterr().out
    results = read_any(out)
    records = {r.variant: r for r in results.records}
    assert set(records) == {"naive", "per-parameter"}
    for variant, r in records.items():
        assert len(r.timelines) == 2 and r.timeline is r.timelines[-1]
        # Each trace, beside profile.json, re-reads to exactly the timelines the run stored.
        assert r.trace in (f"trace_{variant}.json", f"trace_{variant}.json.gz")
        assert extract_step_timelines(load_trace(out.parent / r.trace), "gloo") == r.timelines
        assert r.overlap_fraction == r.timeline.overlap_fraction == r.overlap_fraction_per_step[-1]
        assert r.n_comm_events > 1 and r.communication_s > 0 and r.backward_s > 0
        assert r.timeline.phases["backward"][0] < r.timeline.phases["backward"][1] <= r.timeline.duration_us
    assert records["naive"].overlap_fraction < 0.05
    assert records["per-parameter"].overlap_fraction > records["naive"].overlap_fraction
    # Same number of collectives per step: one per parameter plus the usage count.
    assert records["naive"].n_comm_events == records["per-parameter"].n_comm_events
    assert results.environment.world_size == 2 and results.setting["steps"] == 2
    assert results.notes["ranks_on_node"] == 2 and results.notes["threads_per_rank"] >= 1
    # Pictures are the writeup's job; the profiler leaves only the results and the traces.
    assert sorted(p.name for p in out.parent.iterdir()) == ["profile.json", "trace_naive.json",
                                                             "trace_per-parameter.json"]


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


@pytest.mark.parametrize("variant", ["naive", "per-parameter"])
def test_recorded_gloo_cuda_traces(variant):
    """Excerpts of real traces from one H100 (2 gloo ranks sharing it, small model, the one-GPU
    step of make bench-gpu, cut down by trim_trace.py and gzipped): the lane holds gloo's
    worker events, one per all-reduce, and the host-device copies gloo stages them with; naive
    communicates after backward only, per-parameter partly inside it."""
    trace = load_trace(TRACES / f"gloo_cuda_{variant}.json.gz")
    (t,) = extract_step_timelines(trace, "gloo")
    parameters = len(list(TransformerLM(model_config("small")).parameters()))
    # On the host's worker threads (the same name also marks their spans on the GPU's streams).
    workers = [e for e in trace["traceEvents"] if e.get("name") == "gloo:all_reduce" and e.get("cat") == "user_annotation"]
    assert len(workers) == parameters + 1  # + the usage count
    assert t.device_clock and t.n_comm_events >= len(workers)
    if variant == "naive":
        assert t.overlap_fraction == 0.0
        assert min(a for a, _ in t.communication) >= t.phases["backward"][1]
    else:
        assert 0.0 < t.overlap_fraction < 1.0


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


def _records() -> list[ProfileRecord]:
    return [ProfileRecord.from_timelines("naive", "trace_naive.json", extract_step_timelines(_cpu_trace(), "gloo")),
            ProfileRecord.from_timelines("per-parameter", "trace_per-parameter.json",
                                         [extract_step_timelines(_gloo_cuda_trace(), "gloo")[0]])]


def test_the_record_summarises_the_last_step():
    naive, per_parameter = _records()
    # Both hand-built CPU steps: 40 us of communication, 20 of it inside backward; the step is 100 us.
    assert naive.overlap_fraction_per_step == [0.5, 0.5] and naive.overlap_fraction == 0.5
    assert naive.communication_s == pytest.approx(40e-6) and naive.backward_s == pytest.approx(40e-6)
    assert naive.step_s == pytest.approx(100e-6) and naive.n_comm_events == 3
    assert per_parameter.overlap_fraction == pytest.approx(45 / 50)
    assert "host-device copies" in per_parameter.lanes_from
    with pytest.raises(ValueError, match="no profiled step"):
        ProfileRecord.from_timelines("naive", "trace_naive.json", [])


def test_stored_timelines_read_back_equal_and_draw_the_same_bytes(tmp_path):
    """profile.json keeps the intervals, so the writeup's figure from the file is the figure from the run."""
    records = _records()
    path = write_results(tmp_path / "profile.json", ResultsFile(
        ProfileRecord.KIND, collect_environment("gloo", 2, "cpu"), to_json(ProfileSetting()), records))
    back = read_any(path).records
    assert back == records
    assert list(back[1].timeline.phases) == list(records[1].timeline.phases)  # phases keep their order
    drawn = [render_timelines([(r.variant, r.timeline) for r in rs], tmp_path / f"{name}.png").read_bytes()
             for name, rs in (("run", records), ("file", back))]
    assert drawn[0] == drawn[1]


# -- the command line (no ranks) ----------------------------------------------------------------


@pytest.fixture
def no_ranks(monkeypatch):
    must_not_start(monkeypatch, profile_ddp, "profile_into")


BAD_ARGS = [
    (["--world-size", "0"], "--world-size"),
    (["--steps", "0"], "--steps"),
    (["--warmup-steps", "-1"], "--warmup-steps"),
    (["--variants", "flat"], "--variants"),
    (["--variants", "naive", "naive"], "--variants"),
    (["--global-batch", "0"], "--global-batch"),
]


@pytest.mark.parametrize("args,flag", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_values_stop_before_any_rank_starts(args, flag, no_ranks, capsys):
    assert flag in refused_in_one_line(profile_ddp.main, args, capsys)


def test_an_interrupted_run_writes_nothing(monkeypatch, tmp_path, capsys):
    interrupted_run_writes_nothing(monkeypatch, profile_ddp, "profile_into", tmp_path / "profile.json", capsys,
                                   signal.SIGINT)


def test_the_run_writes_profile_json_where_asked(monkeypatch, tmp_path):
    monkeypatch.setattr(profile_ddp, "profile_into", lambda setting, folder: ProfileRun(_records(), 2, False, 1, 2))
    out = tmp_path / "elsewhere" / "profile.json"
    assert profile_ddp.main(["--out", str(out)]) == 0
    back = read_any(out)
    assert back.records == _records() and back.notes == {"threads_per_rank": 1, "ranks_on_node": 2}


def test_the_nsys_command_records_the_same_run():
    setting = ProfileSetting(model_size="small", context_length=64, global_batch=8, world_size=4, seed=3,
                             warmup_steps=1, steps=5)
    command = shlex.split(nsys_command(setting))
    assert command[:2] == ["nsys", "profile"] and "--nproc-per-node" in command
    flags = dict(zip(command[command.index("scripts/profile_ddp.py") + 1::2],
                     command[command.index("scripts/profile_ddp.py") + 2::2]))
    assert flags == {"--device": "cuda", "--model-size": "small", "--context-length": "64", "--global-batch": "8",
                     "--seed": "3", "--warmup-steps": "1", "--steps": "5"}
    assert command[command.index("--nproc-per-node") + 1] == "4"
    assert nsys_command(setting, Path("x/profile.json")).endswith("--out x/profile.json")
