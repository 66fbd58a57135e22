"""Other Llama-family architectures load and match HF: tiny random-weight Llama 3 (rope scaling),
Qwen2 (qkv bias, untied head) and Mistral models, built and saved with HF transformers here."""

import shutil

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from cluster import LLM, SamplingParams
from tests.hf_reference import compare, hf_greedy

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
COMMON = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    initializer_range=0.2, bos_token_id=1, eos_token_id=2,
)
ARCHITECTURES = {
    "llama3": (LlamaForCausalLM, LlamaConfig(
        **COMMON, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
    )),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**COMMON, tie_word_embeddings=False, rope_theta=1000000.0)),
    "mistral": (MistralForCausalLM, MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=4096)),
}


def save_tiny_model(model_cls, config, out, tokenizer_dir, seed: int = 0):
    """A random-weight model of `config` saved with HF (and the default model's tokenizer)."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(f"{tokenizer_dir}/{name}", f"{out}/{name}")
    return str(out), model


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def tiny_model(request, tmp_path_factory, model_dir):
    model_cls, config = ARCHITECTURES[request.param]
    return save_tiny_model(model_cls, config, tmp_path_factory.mktemp(request.param), model_dir)


def test_tiny_model_matches_hf(tiny_model):
    path, hf_model = tiny_model
    llm = LLM(path, num_blocks=256, max_num_batched_tokens=64)
    prompts = [
        [1 + (7 * i) % 1000 for i in range(n)] for n in (5, 17, 40, 300)
    ] + [llm.engine.encode_prompt("The quick brown fox jumps over the lazy dog.")]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    verdicts = [compare(o.outputs[0].token_ids, hf_greedy(hf_model, p, 16)) for o, p in zip(outputs, prompts)]
    assert verdicts.count("near-tie") <= 1, verdicts
    assert llm.engine.num_free_blocks == 256


def test_qwen2_has_biases_and_llama3_scales_rope(tiny_model):
    path, _ = tiny_model
    config = LLM(path, num_blocks=8).engine.model_config
    if config.model_type == "qwen2":
        assert config.qkv_bias and not config.o_bias
    if config.model_type == "llama":
        assert config.rope_scaling["rope_type"] == "llama3"
