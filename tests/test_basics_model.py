"""The first assignment's blocks in ``cs336_basics.model``: shapes, initialisation, arithmetic.

References are written independently of the module code (a matrix product, a row lookup, the
RMS formula); initialisation is checked by its statistics on large layers, where the sample
standard deviation of a truncated normal is within 2% of its value (truncating N(0, s^2) at
3s leaves a standard deviation of 0.986 s).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import cs336_basics
from cs336_basics.model import Embedding, Linear, RMSNorm, TransformerLM, model_config

pytestmark = pytest.mark.problem("fsdp")


def test_linear_has_one_weight_of_shape_out_by_in_and_computes_x_w_transposed():
    torch.manual_seed(0)
    layer = Linear(5, 3)
    assert [name for name, _ in layer.named_parameters()] == ["weight"]
    assert layer.weight.shape == (3, 5)
    x = torch.randn(2, 4, 5)
    torch.testing.assert_close(layer(x), torch.einsum("bsi,oi->bso", x, layer.weight))


def test_linear_initialisation_is_truncated_normal_of_fan_in_and_out():
    torch.manual_seed(0)
    weight = Linear(300, 500).weight.detach()
    std = math.sqrt(2 / (300 + 500))
    assert weight.abs().max() <= 3 * std
    assert weight.std().item() == pytest.approx(0.986 * std, rel=0.02)


def test_embedding_looks_up_rows_and_is_initialised_truncated_standard_normal():
    torch.manual_seed(0)
    table = Embedding(400, 300)
    assert table.weight.shape == (400, 300)
    assert table.weight.abs().max() <= 3.0
    assert table.weight.std().item() == pytest.approx(0.986, rel=0.02)
    ids = torch.tensor([[3, 0], [399, 3]])
    assert torch.equal(table(ids), table.weight[ids])


def test_blocks_take_device_and_dtype():
    for block in (Linear(4, 2, device="meta", dtype=torch.bfloat16),
                  Embedding(4, 2, device="meta", dtype=torch.bfloat16),
                  RMSNorm(4, device="meta", dtype=torch.bfloat16)):
        (param,) = block.parameters()
        assert param.device.type == "meta" and param.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_has_a_learnable_gain_works_in_float32_and_returns_the_input_dtype(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(6)
    with torch.no_grad():
        norm.gain.copy_(torch.arange(1.0, 7.0))
    x = torch.randn(2, 6).to(dtype)
    x32 = x.float()
    expected = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.gain
    out = norm(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected.to(dtype))


def test_lm_is_built_from_the_blocks_under_the_names_it_always_had():
    model = TransformerLM(model_config("tiny"))
    names = dict(model.named_parameters())
    assert isinstance(model.token_embeddings, Embedding)
    assert isinstance(model.layers[0].attn.q_proj, Linear)
    assert isinstance(model.layers[0].attn_norm, RMSNorm)
    for name in ("token_embeddings.weight", "layers.1.attn.q_proj.weight",
                 "layers.0.ffn.w2.weight", "layers.0.attn_norm.gain", "final_norm.gain",
                 "lm_head.weight"):
        assert name in names


def test_cs336_systems_has_no_second_model_definition():
    """One model definition: cs336_systems imports cs336_basics', it defines none of its own."""
    package = Path(cs336_basics.__file__).resolve().parents[1] / "cs336_systems"
    defined = {
        f"{path.relative_to(package.parent)}: class {name}"
        for path in package.rglob("*.py")
        for name in ("TransformerLM", "RMSNorm", "Embedding", "Linear", "TransformerBlock")
        if re.search(rf"^class {name}\b", path.read_text(), flags=re.MULTILINE)
    }
    assert defined == set()
