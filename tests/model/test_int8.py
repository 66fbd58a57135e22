"""The int8-weight option: close to fp32 per layer, and still a working model end to end."""

import pytest
import torch

from model.layers import Int8Weight, ReplicatedLinear


def test_int8_linear_is_close_to_float():
    torch.manual_seed(0)
    layer = ReplicatedLinear(256, 512, bias=True)
    layer.weight.data.normal_(0, 0.05)
    layer.bias.data.normal_(0, 0.1)
    x = torch.randn(8, 256)
    expected = layer(x)
    layer.quantize_int8()
    assert layer.weight is None and isinstance(layer.int8, Int8Weight)
    out = layer(x)
    assert ((out - expected).norm() / expected.norm()).item() < 0.03


def test_int8_engine_answers_and_frees_its_blocks(model_dir):
    from cluster import LLM, SamplingParams

    llm = LLM(model_dir, num_blocks=64, quantization="int8")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=16, temperature=0))
    assert "Paris" in out[0].outputs[0].text
    assert llm.engine.num_free_blocks == 64


def test_unknown_quantization_is_refused(model_dir):
    from cluster import LLM

    with pytest.raises(ValueError, match="quantization"):
        LLM(model_dir, num_blocks=8, quantization="int3")
