"""The benchmark suites behind ``make bench``, ``make bench-quick`` and ``make bench-gpu``.

A suite is an ordered list of steps; each step runs one of our scripts as its own process
(so that one step's memory, threads and process groups cannot leak into the next, and the
memory accounting sees a fresh process) and writes one results file, at the path
``results.paths`` gives it. The suites end by rendering the writeup.

* ``cpu``: gloo on this machine's CPUs: 27 min 14 s on the 2-core machine, a fresh clone alone on
  it (issue 59), writing over the committed results of this machine's folder;
* ``retake``: the ``cpu`` steps whose file the writeup cites and that is not yet quiet evidence
  (:func:`retake_reason`), on a quiet machine;
* ``quick``: the same path with minimal sizes (a smoke check, under 3 minutes), written to
  ``writeup/results/quick/``, which the writeup ignores;
* ``gpu-memory``: on one GPU, what it can still say at the handout's sizes, every figure from
  fresh processes (:func:`one_gpu_memory_steps`; ``python scripts/run_benchmarks.py --suite gpu-memory``);
* ``gpu``: with 2-6 GPUs, NCCL at the handout's settings (the xl model on 2 GPUs for the DDP
  problems, 2/4/6 GPUs for the all-reduce grid where available); with 1 GPU, gloo ranks sharing
  it (every record says so) and a rehearsal of the multi-GPU DDP runs: NCCL at world size 1 on
  the handout's xl setting, every variant beside torch's DDP. One rank's all-reduce moves
  nothing, so that run measures each wrapper's own cost on a GPU (host work, launches, waits),
  which the 2-6 GPU runs would add to every step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from cs336_systems.results.environment import OTHERS_LIMIT, OTHERS_LIMIT_BY_KIND, REPO_ROOT
from cs336_systems.results.files import ResultsError
from cs336_systems.results.kinds import read_any
from cs336_systems.results.paths import PROFILE_DIR

WRITEUP_DIR = REPO_ROOT / "writeup"  # the rendered pages, whose citations say what the retake reruns


@dataclass(frozen=True)
class BenchStep:
    """One script run of a suite."""

    name: str  # what the progress bar shows
    script: str  # path relative to the repository root
    args: tuple[str, ...]  # its command-line arguments, --out included
    out: str  # the results file it writes

    @property
    def command(self) -> list[str]:
        return [self.script, *self.args, "--out", self.out]


def _steps_for(
    out: Path,
    *,
    allreduce: tuple[str, ...],
    ddp: tuple[str, ...],
    ablation: tuple[str, ...] | None,
    profile: tuple[str, ...],
    sharded: tuple[str, ...],
    fsdp: tuple[str, ...],
    family: tuple[str, ...],
    naive_steps: int,
    claims: tuple[str, ...],
    fsdp_options: tuple[str, ...] | None = None,
    answers: tuple[str, ...] | None = None,
) -> list[BenchStep]:
    steps = [
        BenchStep("all-reduce grid", "scripts/bench_allreduce.py", allreduce, f"{out}/allreduce.json"),
        BenchStep("naive DDP equivalence", "scripts/naive_ddp.py", ("--world-size", "2", "--steps", str(naive_steps)),
                  f"{out}/naive_ddp.json"),
        BenchStep("DDP step benchmark", "scripts/bench_ddp.py", ddp, f"{out}/ddp_step.json"),
    ]
    if ablation is not None:
        steps.append(BenchStep("bucketed DDP ablation", "scripts/bench_ddp.py", (*ablation, "--ablation"),
                               f"{out}/ddp_step-ablation.json"))
    steps.append(BenchStep("bucket size family", "scripts/bench_bucket_family.py", family, f"{out}/bucket_family.json"))
    steps += [
        BenchStep("profiler timelines", "scripts/profile_ddp.py", profile, f"{out}/{PROFILE_DIR}/profile.json"),
        BenchStep("sharded optimizer accounting", "scripts/bench_sharded_optimizer.py", sharded,
                  f"{out}/sharded_optimizer.json"),
        BenchStep("FSDP beside DDP, ZeRO-1 and torch's FSDP", "scripts/bench_fsdp.py", fsdp, f"{out}/fsdp_step.json"),
        BenchStep("tuning guides' claims through Lightning", "scripts/bench_lightning.py", claims,
                  f"{out}/lightning_claims.json"),
        *([BenchStep("FSDP options beside torch's fully_shard", "scripts/bench_fsdp_options.py", fsdp_options,
                     f"{out}/fsdp_options.json")] if fsdp_options is not None else []),
        *([BenchStep("the answers beside the library and torch", "scripts/bench_answers.py", answers,
                     f"{out}/answers_step.json")] if answers is not None else []),
        # Section 8's bytes per rank: gloo on the CPUs wherever the suite runs (seconds; no GPU needed).
        BenchStep("section 8 FFN: bytes each rank sends", "scripts/measure_ffn_bytes.py", (), f"{out}/ffn_bytes.json"),
    ]
    return steps


# 8 sequences: 4 rows per rank at world size 2, one per micro-batch of the accumulation option.
FSDP_OPTIONS_TINY = ("--model-size", "tiny", "--context-length", "32", "--global-batch", "8", "--world-size", "2")
CPU_BUCKET_SIZES_MB = ("1", "10", "25", "100")  # distinct layouts on cpu-small (see cpu_suite)
CPU_DDP = ("--model-size", "cpu-small", "--context-length", "128", "--global-batch", "4", "--world-size", "2")
# Twelve (case, side) pairs a round at the default shape; 32 rounds: the 95% interval of the
# per-round ratio's median runs from the 10th to the 23rd of 32.
FSDP_MODULES_CPU = ("--rounds", "32")


def cpu_suite(out: Path) -> list[BenchStep]:
    return _steps_for(
        out,
        # The guard counts 3 payloads a rank; gloo's CPU ring needs less: 4 ranks x 1000 MB took 3.8 GiB
        # of MemAvailable at most (imports included) against the 11.7 GiB counted, 6 ranks 9.7 GiB
        # against 17.6. With all of what is available, the 6-rank cells fit on this 24 GB machine once
        # the ranks have started (19.8 GiB left); 0.85 of it skipped them. 300 s: the 1000 MB cells
        # take about 50 s at 4 ranks and 80-105 s at 6 (1.9 and 3-4 s an all-reduce).
        allreduce=("--backend", "gloo", "--device", "cpu", "--world-sizes", "2", "4", "6",
                   "--sizes-mb", "1", "10", "100", "1000", "--budget-s", "300", "--memory-fraction", "1"),
        # Many short rounds: this machine is noisy, interleaving finely spreads drift evenly, and
        # each round gives one paired difference per variant; the 95% interval of their median
        # narrows from min..max at 8 rounds to the 4th..13th of 16 and the 10th..23rd of 32.
        # cpu-small's gradients are 86.6 MB: the handout's 100 and 1000 MB would both build the same
        # two buckets (the 19.5 MB lm_head, which closes the 1 MB first bucket, then the rest), so
        # this sweep's sizes build four distinct layouts: 30, 6, 3 and 2 buckets (tests/test_bench_suites.py).
        ddp=(*CPU_DDP, "--rounds", "16", "--steps-per-round", "1", "--bucket-sizes-mb", *CPU_BUCKET_SIZES_MB),
        ablation=(*CPU_DDP, "--rounds", "32", "--steps-per-round", "1"),
        profile=("--model-size", "cpu-small", "--context-length", "128", "--global-batch", "4"),
        sharded=("--model-size", "cpu-small", "--context-length", "128", "--global-batch", "4"),
        fsdp=(*CPU_DDP, "--rounds", "6", "--steps-per-round", "1"),
        family=("--world-size", "2", "--rounds", "16"),
        naive_steps=10,
        # 11 configurations x 10 rounds of a fresh Trainer each (about 4 minutes on 2 cores); 10
        # rounds give a sign-test interval from the 2nd to the 9th of the per-round ratios.
        claims=(*CPU_DDP, "--rounds", "10", "--steps-per-round", "1"),
        # The tiny LM: twelve (option, side) pairs per round, sixteen rounds: 4 minutes on this
        # 2-core machine while other jobs held a load average near 20.
        fsdp_options=(*FSDP_OPTIONS_TINY, "--rounds", "16"),
        # Twelve configurations a round (four techniques, three implementations each).
        answers=(*CPU_DDP, "--rounds", "8"),
    ) + [fsdp_hybrid_step(out), *fsdp_module_steps(out, FSDP_MODULES_CPU)]


def retake_reason(path: Path) -> str | None:
    """Why a results file's timings decide nothing yet, or None: missing or unreadable, no load
    record or no host record (steal, calibration: taken before they were recorded), a load over the
    run's own (held to its kind's limit: the profile's is 0.25), or a host that was not quiet."""
    try:
        results = read_any(path)
    except (OSError, ResultsError):
        return "missing or unreadable"
    load, host = results.environment.load, results.environment.host
    if load is None:
        return "no load record"
    load = replace(load, others_limit=OTHERS_LIMIT_BY_KIND.get(results.kind, OTHERS_LIMIT))
    if load.exceeded:
        return load.why_busy()
    if host is None:
        return "no steal or calibration record"
    return None if host.quiet else "not quiet: " + "; ".join(host.reasons)


def cited_files(folder: Path, pages: Path = WRITEUP_DIR) -> set[str]:
    """The files of a machine folder that the rendered writeup cites (as `<tag>/<file>`, in its
    setting lines and answers), relative to the folder."""
    text = "\n".join(p.read_text() for p in [pages / "README.md", *sorted((pages / "details").glob("*.md"))]
                     if p.is_file())
    return set(re.findall(rf"`{re.escape(Path(folder).name)}/([\w./-]+\.json)`", text))


def retake_suite(out: Path, pages: Path = WRITEUP_DIR) -> list[BenchStep]:
    """The steps of ``make bench`` whose results file under ``out`` the writeup cites and that has a
    :func:`retake_reason`, run on a quiet machine: each file then records its load and host, and
    save_results files a run that was not quiet apart from a quieter one in place."""
    cited = cited_files(out, pages)
    return [step for step in cpu_suite(out)
            if Path(step.out).relative_to(out).as_posix() in cited and retake_reason(Path(step.out))]


def fsdp_module_steps(out: Path, args: tuple[str, ...]) -> list[BenchStep]:
    """Our fully_shard beside torch's on the six models of bench/fsdp/modules.py, at 2 and 3 gloo
    ranks (the issue's two world sizes; 3 ranks share this machine's 2 cores)."""
    return [BenchStep(f"FSDP on torch's modules beside fully_shard, {n} ranks", "scripts/bench_fsdp_modules.py",
                      ("--world-size", str(n), *args), f"{out}/fsdp_modules{'' if n == 2 else f'-ws{n}'}.json")
            for n in (2, 3)]


def fsdp_hybrid_step(out: Path) -> BenchStep:
    """Every FSDP option again at 4 ranks, where hybrid sharding (2 x 2) runs too: gloo ranks
    sharing this machine's CPUs, 4 rows each (one per micro-batch of the accumulation option)."""
    args = (*FSDP_OPTIONS_TINY[:4], "--global-batch", "16", "--world-size", "4", "--rounds", "6")
    return BenchStep("FSDP options at 4 ranks, hybrid sharding among them", "scripts/bench_fsdp_options.py", args,
                     f"{out}/fsdp_options-ws4.json")


def quick_suite(out: Path) -> list[BenchStep]:
    tiny = ("--model-size", "tiny", "--context-length", "32")
    return _steps_for(
        out,
        allreduce=("--backend", "gloo", "--device", "cpu", "--world-sizes", "2",
                   "--sizes-mb", "0.01", "0.1", "1", "--budget-s", "30"),
        ddp=(*tiny, "--global-batch", "4", "--rounds", "1", "--steps-per-round", "2", "--bucket-sizes-mb", "0.1", "1"),
        ablation=(*tiny, "--global-batch", "4", "--rounds", "1", "--steps-per-round", "1"),
        profile=(*tiny, "--global-batch", "4"),
        sharded=(*tiny, "--global-batch", "4", "--steps", "2"),
        fsdp=(*tiny, "--global-batch", "4", "--rounds", "2", "--steps-per-round", "1"),
        family=("--models", "many-small", "--rounds", "1", "--warmup-steps", "0"),
        naive_steps=3,
        claims=(*tiny, "--global-batch", "4", "--rounds", "2", "--steps-per-round", "1", "--batchnorm-steps", "2"),
        fsdp_options=(*FSDP_OPTIONS_TINY, "--rounds", "2"),
        answers=(*tiny, "--global-batch", "4", "--rounds", "2"),
    ) + fsdp_module_steps(out, ("--d-model", "16", "--num-heads", "2", "--d-ff", "32", "--num-layers", "2",
                                "--vocab-size", "64", "--context-length", "8", "--rounds", "2"))


def nccl_rehearsal_step(out: Path) -> BenchStep:
    """xl on one GPU with NCCL at world size 1: every wrapper's own cost beside torch's DDP."""
    args = ("--device", "cuda", "--backend", "nccl", "--world-size", "1", "--model-size", "xl",
            "--context-length", "128", "--global-batch", "4", "--rebuild-each-round",
            "--rounds", "5", "--steps-per-round", "2", "--bucket-sizes-mb", "1", "10", "25", "100", "1000")
    return BenchStep("DDP step, NCCL world size 1 (xl)", "scripts/bench_ddp.py", args, f"{out}/ddp_step-nccl1.json")


def one_gpu_memory_steps(out: Path, model_size: str = "xl", claims_size: str = "medium", rounds: int = 6,
                         device: str = "cuda") -> list[BenchStep]:
    """What one GPU can still say at the handout's sizes, each figure from fresh processes.

    * the sharded optimizer's accounting (optimizer_state_sharding_accounting (a)) and every
      configuration's peak beside FSDP's (fsdp_accounting (a)) at xl, two gloo ranks sharing
      the GPU: each rank has its own allocator, so memory does not depend on the backend;
    * gradient_as_bucket_view and bf16-mixed on torch's DDP at world size 1 (NCCL; nothing to
      all-reduce, so the GPU's own effects), every fit in a process of its own so that no peak
      includes an earlier fit's leftovers; 6 rounds: the sign test's min..max interval (96.9%).
    ``device``/sizes are parameters so that the same steps run on a CPU at tiny sizes (a dry run)."""
    backend = "nccl" if device == "cuda" else "gloo"
    shared = ("--device", device, "--backend", "gloo", "--world-size", "2", "--model-size", model_size,
              "--context-length", "128", "--global-batch", "8")
    return [
        BenchStep("sharded optimizer accounting, two ranks sharing the GPU", "scripts/bench_sharded_optimizer.py",
                  (*shared, "--steps", "1"), f"{out}/sharded_optimizer-{model_size}.json"),
        BenchStep("peak memory per configuration, each in its own processes", "scripts/bench_fsdp_memory.py",
                  (*shared, "--configurations", "ddp", "zero1", "fsdp"), f"{out}/fsdp_memory.json"),
        BenchStep("gradient views and bf16 at world size 1, one fit per process", "scripts/bench_lightning.py",
                  ("--device", device, "--backend", backend, "--world-size", "1", "--model-size", claims_size,
                   "--context-length", "128", "--global-batch", "16", "--rounds", str(rounds), "--steps-per-round", "2",
                   "--configs", "torch", "torch+views", "torch+bf16", "--fit-per-process"),
                  f"{out}/lightning_claims-ws1.json"),
    ]


def claims_gpu_args(gpu_count: int) -> tuple[str, ...]:
    """The claims benchmark on GPUs: NCCL with two GPUs or more; with one, two ranks share it over
    gloo (our strategy leaves one process unwrapped, so world size 1 would compare torch's DDP with
    no DDP). cpu-small keeps 11 configurations x 10 rounds of fresh Trainers within about 3 minutes."""
    backend = ("--backend", "nccl") if gpu_count >= 2 else ("--backend", "gloo")
    return ("--device", "cuda", *backend, "--world-size", "2", "--model-size", "cpu-small", "--context-length", "128",
            "--global-batch", "8", "--rounds", "10", "--steps-per-round", "2")


def gpu_suite(out: Path, gpu_count: int) -> list[BenchStep]:
    """Raises ValueError without a GPU: there is nothing of this suite to run."""
    if gpu_count < 1:
        raise ValueError("no CUDA GPU is visible: `make bench-gpu` needs a node with 1-6 GPUs (run `make bench` for CPUs)")
    if gpu_count == 1:
        # NCCL needs one GPU per rank: with one GPU, ranks share it through gloo, and every
        # record says so. The xl model does not fit twice on one GPU; "small" does.
        ddp = ("--device", "cuda", "--backend", "gloo", "--model-size", "small",
               "--context-length", "128", "--global-batch", "8", "--world-size", "2")
        return _steps_for(
            out,
            allreduce=("--backend", "gloo", "--device", "cuda", "--world-sizes", "2", "4", "6",
                       "--sizes-mb", "1", "10", "100", "1000"),
            ddp=(*ddp, "--rounds", "3", "--steps-per-round", "3"),
            ablation=(*ddp, "--rounds", "3", "--steps-per-round", "3"),
            profile=ddp,
            sharded=("--device", "cuda", "--backend", "gloo", "--model-size", "small", "--global-batch", "8"),
            fsdp=(*ddp, "--rounds", "3", "--steps-per-round", "2"),
            family=("--device", "cuda", "--backend", "gloo", "--world-size", "2", "--rounds", "8"),
            naive_steps=10,
            claims=claims_gpu_args(gpu_count),
            fsdp_options=(*ddp, "--rounds", "8"),
        ) + [nccl_rehearsal_step(out)]
    world_sizes = [str(n) for n in (2, 4, 6) if n <= gpu_count]
    xl = ("--device", "cuda", "--model-size", "xl", "--context-length", "128", "--global-batch", "16", "--world-size", "2")
    # xl's float32 gradients are several GB: every wrapper alive at once, each with its own
    # buffers, would not fit beside the model and AdamW's state, so they take turns.
    xl_step = (*xl, "--rebuild-each-round")
    return _steps_for(
        out,
        allreduce=("--backend", "nccl", "--device", "cuda", "--world-sizes", *world_sizes,
                   "--sizes-mb", "1", "10", "100", "1000"),
        ddp=(*xl_step, "--rounds", "3", "--steps-per-round", "3", "--bucket-sizes-mb", "1", "10", "100", "1000"),
        ablation=(*xl_step, "--rounds", "3", "--steps-per-round", "3"),
        profile=xl,
        sharded=("--device", "cuda", "--model-size", "xl", "--context-length", "128", "--global-batch", "8"),
        # Every configuration keeps its own model copy and optimizer on each GPU: xl would not fit
        # four times, medium does.
        fsdp=("--device", "cuda", "--model-size", "medium", "--context-length", "128", "--global-batch", "8",
              "--world-size", "2", "--rounds", "3", "--steps-per-round", "2"),
        family=("--device", "cuda", "--world-size", "2", "--rounds", "8"),
        naive_steps=10,
        claims=claims_gpu_args(gpu_count),
        # Hybrid sharding (2 x 2) where 4 GPUs are there; medium, as the FSDP step benchmark.
        fsdp_options=("--device", "cuda", "--model-size", "medium", "--context-length", "128", "--global-batch", "16",
                      "--world-size", "4" if gpu_count >= 4 else "2", "--rounds", "8"),
    )
