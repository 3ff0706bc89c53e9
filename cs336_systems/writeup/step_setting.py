"""What a DDP run's numbers depend on, as values for the templates: model, batch, optimizer, timing, cores.

Everything comes from the results file (its setting, environment and notes) and from
:mod:`cs336_basics.model`'s size table, so a run on another machine or model describes itself. Also the buckets a bucketed run built (its
record's ``bucket_bytes`` and ``bucket_params``, in launch order), and with the model's shapes (built
on the meta device, allocating nothing) why a cap above all gradients still builds two buckets.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cs336_basics.model import (EDITION_MODEL_SIZES, TransformerConfig, TransformerLM, expected_parameter_count,
                                model_config)
from cs336_systems.bench.allreduce.setting import FLOAT32_BYTES
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.setting import LEARNING_RATE
from cs336_systems.results.host import SPREAD_LIMIT, compute_only_times, spread
from cs336_systems.writeup import fmt
from cs336_systems.writeup.load import ResultsFile

# Per parameter on each rank while training with AdamW in float32: weights, gradients, and the
# optimizer's two moments (exp_avg, exp_avg_sq).
TRAINING_BYTES_PER_PARAMETER = 4 * FLOAT32_BYTES
HANDOUT_MODEL = "xl"  # the size the handout's DDP problems ask for
OPTIMIZER = "AdamW"  # what cs336_systems/bench/step/run.py steps with, at LEARNING_RATE
SHOWN_NAMES = 3  # parameters named per bucket before the rest are counted


def parameter_shapes(setting: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the run's model ({} if the size is unknown here)."""
    config = config_of(setting)
    if config is None:
        return {}
    with torch.device("meta"):
        model = TransformerLM(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def buckets(r: StepRecord) -> list[dict[str, Any]]:
    """Each bucket in launch order: payload bytes, parameter count, the first few names."""
    return [dict(bytes=b, count=len(names), names=names[:SHOWN_NAMES])
            for names, b in zip(r.bucket_params or [], r.bucket_bytes or [])]


def large_cap(sweep: list[StepRecord], s_bytes: float | None, shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """The caps that hold all ``s_bytes`` yet built more than one bucket, and why: the first bucket's own
    cap (``first_bucket_mb``) and whether the first gradient alone exceeds it; None if no cap does."""
    large = [r for r in sweep if s_bytes and r.bucket_cap_bytes is not None and r.bucket_cap_bytes >= s_bytes
             and (r.n_buckets or 0) > 1 and r.bucket_params and r.bucket_bytes]
    if not large:
        return None
    r = large[0]
    first = r.bucket_params[0] if r.bucket_params else []
    first_bytes = FLOAT32_BYTES * math.prod(shapes[first[0]]) if len(first) == 1 and first[0] in shapes else None
    # Caps that hold every gradient all build the same plan (the first bucket, then the rest): their
    # step times differ only by noise.
    same_plan = len(large) > 1 and all(x.bucket_bytes == r.bucket_bytes for x in large)
    return dict(caps=[x.bucket_size_mb for x in large], counts=sorted({x.n_buckets for x in large}), record=r,
                records=large, same_plan=same_plan,
                first_cap=r.first_bucket_cap_bytes, first=first[0] if len(first) == 1 else None,
                first_shape=shapes.get(first[0]) if first_bytes else None, first_bytes=first_bytes)


def config_of(setting: dict[str, Any]) -> TransformerConfig | None:
    """The model a run trained, from its stored setting; None if the size is unknown here."""
    try:
        return model_config(setting.get("model_size", ""), setting.get("context_length"))
    except (ValueError, TypeError):
        return None


def ddp_setting_line(results: ResultsFile) -> str:
    """The one-line setting of a DDP step run: hardware, backend, ranks, model, batch, optimizer, rounds."""
    env, setting = results.environment, results.setting
    n = results.notes.get("n_parameters")
    rounds, per_round = setting.get("rounds"), setting.get("steps_per_round")
    parts = [f"backend {env.backend}", f"world size {env.world_size}",
             f"model {setting.get('model_size', '?')}" + (f" ({fmt.sig(n / 1e6)}M parameters)" if n else ""),
             f"global batch {setting.get('global_batch', '?')} × context {setting.get('context_length', '?')}",
             f"{OPTIMIZER} lr {LEARNING_RATE:g}"]
    if rounds and per_round:
        parts.append(f"{rounds * per_round} timed steps per variant in {rounds} interleaved rounds")
    # A file from before the host record (whose describe() says it) still shows how quiet it was.
    if env.host is None and (spread_of := spread(compute_only_times(results.records) or [])):
        parts.append(f"compute-only step spread {spread_of[0]:.3f} of its median (max/min {spread_of[1]:.2f}; "
                     f"quiet at most {SPREAD_LIMIT})")
    return fmt.setting_line(env, results.source, parts=parts)


def run_facts(results: ResultsFile, compute_only_s: float | None = None) -> dict[str, Any]:
    """The model's shape and size, batch per rank, warm-up, threads and cores, GPU caveats, and for a
    CPU run of a smaller model what the handout's xl would need (memory, and time at this run's pace)."""
    env, setting, notes = results.environment, results.setting, results.notes
    config = config_of(setting)
    n = expected_parameter_count(config) if config else None
    ranks = notes.get("ranks_on_node") or env.world_size
    threads, batch = notes.get("threads_per_rank"), setting.get("global_batch")
    facts = dict(size=setting.get("model_size", "?"), config=config, n=n, s_bytes=FLOAT32_BYTES * n if n else None,
                 batch=batch, per_rank=batch // env.world_size if batch and env.world_size else None,
                 warmup=setting.get("warmup_steps"), rounds=setting.get("rounds"),
                 per_round=setting.get("steps_per_round"), optimizer=OPTIMIZER, lr=LEARNING_RATE,
                 ranks=ranks, threads=threads, cores=env.cpu_count, cpu=env.device_type == "cpu",
                 busy=ranks * threads if threads else None, world_size=env.world_size,
                 gloo_on_cuda=env.device_type == "cuda" and "gloo" in env.backend.split(","),
                 shared_gpu=env.device_type == "cuda" and env.shared_gpu, xl=None)
    if env.device_type == "cpu" and config and n and facts["size"] != HANDOUT_MODEL:
        xl = model_config(HANDOUT_MODEL, config.context_length)
        n_xl = expected_parameter_count(xl)
        steps = (facts["warmup"] or 0) + (facts["rounds"] or 0) * (facts["per_round"] or 0)
        step_s = compute_only_s * n_xl / n if compute_only_s else None
        n_2026 = expected_parameter_count(EDITION_MODEL_SIZES["2026"][HANDOUT_MODEL])
        facts["xl"] = dict(config=xl, n=n_xl, per_rank_bytes=TRAINING_BYTES_PER_PARAMETER * n_xl,
                           per_rank_bytes_2026=TRAINING_BYTES_PER_PARAMETER * n_2026,
                           bytes_per_parameter=TRAINING_BYTES_PER_PARAMETER, memory=notes.get("host_memory_bytes"),
                           step_s=step_s, hours=step_s * steps * len(results.records) / 3600 if step_s else None)
    return facts
