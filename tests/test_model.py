"""The benchmarks' workload, the Transformer LM of ``cs336_basics/model.py``, checked on CPU.

Every DDP benchmark times this model, so its numbers mean something only if the model is the
architecture it claims: causal, of the stated size, and trainable. References here are
independent of the module code: a parameter-count formula, hand-written attention and RMS
normalisation, and the relative-position property that defines RoPE.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cs336_basics.model import (
    MODEL_SIZES,
    CausalSelfAttention,
    RMSNorm,
    RotaryEmbedding,
    TransformerConfig,
    TransformerLM,
    count_parameters,
    expected_parameter_count,
    model_config,
)

pytestmark = pytest.mark.problem("naive_ddp_benchmarking")

HANDOUT_SIZES = ("small", "medium", "large", "xl", "2.7B")


@pytest.fixture(autouse=True)
def one_thread():
    """Run on one thread: these models are too small to gain from intra-op parallelism, and
    under ``pytest -n auto`` the other workers already hold the remaining cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny(seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(model_config("tiny")).eval()


def _tokens(config: TransformerConfig, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, seq), generator=g)


@pytest.mark.parametrize("t", [1, 16, 31])
def test_changing_a_token_changes_no_earlier_logits(t: int):
    """Position t's token may influence logits at positions >= t only.

    Earlier positions must match to 1e-6 absolute: their computation sees the same inputs,
    and only a different order of floating-point reduction inside a kernel could move them.
    """
    model = _tiny()
    tokens = _tokens(model.config, batch=2, seq=model.config.context_length)
    changed = tokens.clone()
    changed[:, t] = (tokens[:, t] + 1) % model.config.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0.0, atol=1e-6)
    assert (after[:, t] - before[:, t]).abs().amax(dim=-1).min() > 1e-3


@pytest.mark.parametrize("name", ["tiny", "cpu-small"])
def test_module_has_the_parameters_the_formula_predicts(name: str):
    model = TransformerLM(model_config(name))
    assert count_parameters(model) == expected_parameter_count(model.config)


def test_handout_sizes_match_the_formula_without_allocating():
    """Built on the meta device (shapes only, no memory), so xl and 2.7B cost nothing to check."""
    for name in HANDOUT_SIZES:
        with torch.device("meta"):
            model = TransformerLM(model_config(name))
        assert count_parameters(model) == expected_parameter_count(model.config), name


def test_count_parameters_counts_a_shared_weight_once():
    model = TransformerLM(model_config("tiny"))
    untied = count_parameters(model)
    model.lm_head.weight = model.token_embeddings.weight  # both are [vocab, d_model]
    assert count_parameters(model) == untied - model.config.vocab_size * model.config.d_model


def test_logits_shape_and_dtype():
    model = _tiny()
    tokens = _tokens(model.config, batch=3, seq=20)  # shorter than the context is fine
    logits = model(tokens)
    assert logits.shape == (3, 20, model.config.vocab_size)
    assert logits.dtype == torch.float32


def test_backward_gives_every_parameter_a_finite_nonzero_gradient():
    model = _tiny().train()
    data = _tokens(model.config, batch=2, seq=model.config.context_length + 1)
    logits = model(data[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
    # At initialisation the prediction is near uniform: loss close to log(vocab).
    assert abs(loss.item() - math.log(model.config.vocab_size)) < 1.0
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_too_long_or_malformed_input_raises():
    model = _tiny()
    n = model.config.context_length
    with pytest.raises(ValueError, match=f"{n + 1} tokens exceeds the context length {n}"):
        model(_tokens(model.config, batch=1, seq=n + 1))
    with pytest.raises(ValueError, match="shape"):
        model(torch.zeros(n, dtype=torch.long))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"d_model": 66, "num_heads": 4}, "d_model=66 is not divisible by num_heads=4"),
        ({"d_model": 12, "num_heads": 4, "d_ff": 32}, "3 must be even"),
        ({"num_layers": 0}, "num_layers must be a positive int, got 0"),
        ({"vocab_size": -5}, "vocab_size must be a positive int, got -5"),
        ({"d_ff": 128.0}, "d_ff must be a positive int, got 128.0"),
        ({"rope_theta": 0.0}, "rope_theta must be > 0, got 0.0"),
    ],
)
def test_bad_config_raises(overrides: dict, message: str):
    base = dict(context_length=32, d_model=64, d_ff=128, num_layers=2, num_heads=4)
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**{**base, **overrides})


def test_model_config_lookup_and_context_override():
    config = model_config("small", context_length=512)
    assert config.context_length == 512
    assert (config.d_model, config.d_ff, config.num_layers, config.num_heads) == (768, 3072, 12, 12)
    assert MODEL_SIZES["small"].context_length == 256  # the table itself is untouched
    with pytest.raises(ValueError, match="known sizes: .*cpu-small"):
        model_config("huge")
    with pytest.raises(ValueError, match="context_length must be a positive int, got 0"):
        model_config("tiny", context_length=0)


def test_rope_tables_are_buffers_left_out_of_checkpoints():
    model = TransformerLM(model_config("tiny"))
    assert {"rotary.cos", "rotary.sin"} <= dict(model.named_buffers()).keys()
    assert not any(key.startswith("rotary.") for key in model.state_dict())


def test_rope_scores_depend_only_on_relative_position():
    """RoPE's defining property: <R_i q, R_j k> is a function of i - j; rotations keep norms."""
    head_dim, context = 16, 64
    rope = RotaryEmbedding(head_dim, context, theta=10_000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, head_dim, generator=g)
    q_at = rope(q.expand(context, head_dim))  # row p: q rotated for position p
    k_at = rope(k.expand(context, head_dim))
    torch.testing.assert_close(q_at[0], q)  # position 0: no rotation
    torch.testing.assert_close(q_at.norm(dim=-1), q.norm().expand(context))
    for i, j, shift in [(5, 2, 10), (3, 9, 40), (20, 20, 7)]:
        shifted = q_at[i + shift] @ k_at[j + shift]
        torch.testing.assert_close(q_at[i] @ k_at[j], shifted, atol=1e-5, rtol=1e-5)


def test_attention_matches_an_explicit_masked_softmax():
    config = model_config("tiny")
    torch.manual_seed(0)
    attn = CausalSelfAttention(config)
    rope = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta)
    x = torch.randn(2, 10, config.d_model)
    with torch.no_grad():
        out = attn(x, rope)
        h, dh = config.num_heads, config.head_dim
        heads = []
        for i in range(h):
            cols = slice(i * dh, (i + 1) * dh)
            q = rope(x @ attn.q_proj.weight[cols].T)
            k = rope(x @ attn.k_proj.weight[cols].T)
            v = x @ attn.v_proj.weight[cols].T
            scores = q @ k.transpose(-1, -2) / math.sqrt(dh)
            future = torch.ones(10, 10, dtype=torch.bool).triu(diagonal=1)
            heads.append(scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v)
        expected = torch.cat(heads, dim=-1) @ attn.output_proj.weight.T
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_rmsnorm_matches_torch_rms_norm():
    torch.manual_seed(0)
    norm = RMSNorm(24)
    with torch.no_grad():
        norm.gain.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 24)
    expected = F.rms_norm(x, (24,), weight=norm.gain, eps=1e-5)
    torch.testing.assert_close(norm(x), expected)
