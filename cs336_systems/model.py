"""The benchmarks' workload, defined once in :mod:`cs336_basics.model` and re-exported here.

Importers of ``cs336_systems.model`` keep working; new code imports ``cs336_basics.model``.
"""

from cs336_basics.model import (  # noqa: F401
    MODEL_SIZES,
    CausalSelfAttention,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    TransformerBlock,
    TransformerConfig,
    TransformerLM,
    count_parameters,
    expected_parameter_count,
    model_config,
)
