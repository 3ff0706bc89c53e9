"""What a DDP run's numbers depend on, said in words: the model, the timing rules, threads and cores, GPUs.

Every sentence is built from the results file (its setting, environment and notes) and from
:mod:`cs336_basics.model`'s size table, so a run on another machine or model describes itself.
Shared by the DDP problem sections, the profile and the lever ablation.
"""

from __future__ import annotations

from typing import Any

from cs336_basics.model import TransformerConfig, expected_parameter_count, model_config
from cs336_systems.results.environment import Environment
from cs336_systems.writeup import fmt

GRADIENT_BYTES = 4  # float32 gradients, as every benchmark trains in float32
# Per parameter on each rank while training with AdamW in float32: weights, gradients, and the
# optimizer's two moments (exp_avg, exp_avg_sq), 4 bytes each.
TRAINING_BYTES_PER_PARAMETER = 16
HANDOUT_MODEL = "xl"  # the size the handout's DDP problems ask for


def config_of(setting: dict[str, Any]) -> TransformerConfig | None:
    """The model a run trained, from its stored setting; None if the size is unknown here."""
    try:
        return model_config(setting.get("model_size", ""), setting.get("context_length"))
    except (ValueError, TypeError):
        return None


def shape_text(config: TransformerConfig) -> str:
    return (f"d_model {config.d_model}, d_ff {config.d_ff}, {config.num_layers} layers, {config.num_heads} heads, "
            f"a {config.vocab_size:,}-token vocabulary, context {config.context_length}")


def model_sentence(setting: dict[str, Any], world_size: int | None = None) -> str:
    """"`cpu-small` is the Transformer LM of `cs336_basics.model` with ...: 22.7M parameters, ..."."""
    size = setting.get("model_size", "?")
    config = config_of(setting)
    if config is None:
        return f"Model `{size}` is not a size `cs336_basics.model` knows, so its shape is not stated here."
    n = expected_parameter_count(config)
    batch, ranks = setting.get("global_batch"), world_size or setting.get("world_size")
    batch_text = ""
    if batch and ranks:
        batch_text = (f" Each step trains a global batch of {batch} sequences of {config.context_length} tokens, "
                      f"{batch // ranks} per rank.")
    return (f"Model `{size}` is the Transformer LM of `cs336_basics.model` with {shape_text(config)}: "
            f"{fmt.sig(n / 1e6)}M parameters, so each step all-reduces s = {fmt.mb(GRADIENT_BYTES * n)} MB of "
            f"float32 gradients.{batch_text}")


def threads_sentence(env: Environment, notes: dict[str, Any]) -> str:
    """Threads per rank against the cores, and what gloo's own threads add on top."""
    threads = notes.get("threads_per_rank")
    ranks = notes.get("ranks_on_node") or env.world_size
    cores = env.cpu_count
    if threads is None:
        return "Threads per rank were not recorded in this run."
    text = f"Each of the {ranks} ranks on this machine computed with {threads} thread{'s' if threads != 1 else ''}"
    if env.device_type != "cpu":
        return text + " on the host (the model ran on the GPU)."
    if not cores:
        return text + "; the core count was not recorded."
    busy = ranks * threads
    text += f" ({busy} compute threads on {cores} logical cores"
    if busy > cores:
        text += f": oversubscribed, {fmt.sig(busy / cores)} threads per core)"
    elif busy == cores:
        text += ": every core computing)"
    else:
        text += f": {cores - busy} cores left idle)"
    return (text + ". gloo runs each all-reduce on threads of its own beside them, so communication that overlaps "
            "compute " + ("competes with it for the cores." if busy >= cores else "can use the idle cores."))


def timing_sentence(setting: dict[str, Any]) -> str:
    """Warm-up, barriers, slowest rank, interleaving."""
    warmup = setting.get("warmup_steps")
    warm = (f"Each variant ran {warmup} untimed warm-up step{'s' if warmup != 1 else ''} before its first timed one"
            if warmup is not None else "Warm-up steps were not recorded")
    return (f"{warm}; every timed step starts after a barrier, and its time is the slowest rank's (a data-parallel "
            "step ends when its last rank does). Variants take turns round by round, so step i of every variant "
            "ran in the same round, under the same load.")


def gpu_notes(env: Environment) -> list[str]:
    """What a GPU run's numbers mean when gloo or a shared GPU is involved; [] otherwise."""
    if env.device_type != "cuda":
        return []
    notes = []
    if "gloo" in env.backend.split(","):
        notes.append("gloo on CUDA tensors copies each tensor to host memory and reduces it there on the CPU, so "
                     "these all-reduces are bounded by host copies and CPU work, not by the GPUs' links.")
    if env.shared_gpu:
        notes.append(f"The {env.world_size} ranks take turns on one GPU: their compute does not run at the same "
                     "time, so a step here is longer than on one GPU per rank.")
    return notes


def setting_paragraph(setting: dict[str, Any], env: Environment, notes: dict[str, Any],
                      timed: bool = True) -> str:
    """The model, the timing rules (for timed runs), threads and cores, GPU caveats: one paragraph."""
    parts = [model_sentence(setting, env.world_size)]
    if timed:
        parts.append(timing_sentence(setting))
    parts.append(threads_sentence(env, notes))
    parts += gpu_notes(env)
    return " ".join(parts)


def short_setting(setting: dict[str, Any], env: Environment, notes: dict[str, Any], defined_in: str) -> str:
    """The setting in one sentence, for sections after the one that states it in full."""
    config = config_of(setting)
    model = f"model `{setting.get('model_size', '?')}`"
    if config is not None:
        n = expected_parameter_count(config)
        model += f" ({fmt.sig(n / 1e6)}M parameters, s = {fmt.mb(GRADIENT_BYTES * n)} MB of gradients)"
    warmup = setting.get("warmup_steps")
    threads = notes.get("threads_per_rank")
    parts = [model, f"{warmup} warm-up step{'s' if warmup != 1 else ''} per variant" if warmup is not None else None,
             "each step timed on its slowest rank",
             (f"{notes.get('ranks_on_node') or env.world_size} ranks × {threads} thread{'s' if threads != 1 else ''} on "
              f"{env.cpu_count} logical cores") if threads and env.device_type == "cpu" and env.cpu_count else None]
    text = "Setting: " + "; ".join(p for p in parts if p) + f" (stated in full under {defined_in})."
    return " ".join([text, *gpu_notes(env)])


def why_not_handout_model(setting: dict[str, Any], env: Environment, notes: dict[str, Any],
                          compute_only_s: float | None, steps_per_variant: int, variants: int) -> str | None:
    """Why this CPU run does not train the handout's xl model: its memory and time, from parameter counts."""
    config = config_of(setting)
    if env.device_type != "cpu" or config is None or setting.get("model_size") == HANDOUT_MODEL:
        return None
    xl = model_config(HANDOUT_MODEL, config.context_length)
    n_xl, n_run = expected_parameter_count(xl), expected_parameter_count(config)
    per_rank = TRAINING_BYTES_PER_PARAMETER * n_xl
    ranks = notes.get("ranks_on_node") or env.world_size
    memory = notes.get("host_memory_bytes")
    text = (f"Why not the handout's `{HANDOUT_MODEL}` ({shape_text(xl)}: {fmt.sig(n_xl / 1e9)}B parameters): "
            f"training it with AdamW in float32 holds {TRAINING_BYTES_PER_PARAMETER} bytes per parameter on each "
            f"rank (weights, gradients, two moments), {fmt.sig(per_rank / 1e9)} GB per rank and "
            f"{fmt.sig(ranks * per_rank / 1e9)} GB for {ranks} ranks before activations and bucket buffers")
    text += (f", against {fmt.sig(memory / 1e9)} GB of memory on this machine" if memory else "") + "."
    if compute_only_s:
        step_xl = compute_only_s * n_xl / n_run
        total = step_xl * steps_per_variant * variants
        text += (f" Its compute grows with parameters × tokens, so at this run's tokens a step would take about "
                 f"{fmt.sig(n_xl / n_run)}× the compute-only step here, {fmt.sig(step_xl)} s, and this run's "
                 f"{variants} variants × {steps_per_variant} steps about {fmt.sig(total / 3600)} hours.")
    return text
