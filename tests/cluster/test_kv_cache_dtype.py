"""kv_cache_dtype: a bf16 KV cache under the fp32 default model, on the real model. It holds twice
the blocks in the same bytes and gives them all back; the paged kernel (with the C++ layer stack)
and the torch path read it alike; its pages go down to disk and come back byte for byte, and
never serve an fp32 cache (they hold other values)."""

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.executor.factory import build_engine
from tests.cluster.test_kv_tiers_engine import answer
from tests.parity_prompts import DOC

BF16 = {"kv_cache_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer(DOC[:1600] + "\nIn one sentence, the text says that").input_ids[-300:]


def engine_of(model_dir, **options) -> LLMEngine:
    return build_engine(EngineConfig(model=model_dir, max_num_batched_tokens=128, **options))


def test_a_bf16_cache_holds_twice_the_blocks_and_gives_them_all_back(model_dir, prompt):
    fp32_block = 30 * 2 * 3 * 16 * 64 * 4  # layers, K and V, KV heads, tokens, head_dim, bytes
    fp32, bf16 = (engine_of(model_dir, kv_cache_bytes=40 * fp32_block, **options) for options in ({}, BF16))
    assert fp32.executor.bytes_per_block == fp32_block == 2 * bf16.executor.bytes_per_block
    assert (fp32.num_blocks, bf16.num_blocks) == (40, 80)
    assert bf16.executor.kv_cache.dtype == torch.bfloat16
    assert bf16.executor.describe()[0]["kv_cache_dtype"] == "bfloat16"
    assert len(answer(bf16, "a", prompt)) == 8
    assert bf16.num_free_blocks == bf16.num_blocks
    assert bf16.model_identity != fp32.model_identity and "-kv-bfloat16" in bf16.model_identity


def test_the_kernel_and_the_torch_path_read_a_bf16_cache_alike(model_dir, prompt, monkeypatch):
    kernel = engine_of(model_dir, num_blocks=64, **BF16)
    assert kernel.executor.describe()[0]["attention"] == "paged kernel, layer stack"
    monkeypatch.setenv("PAGODA_DECODE_STACK", "0")
    gathered = engine_of(model_dir, num_blocks=64, **BF16)
    gathered.executor.kernel_max_queries = 0  # decodes through index_select + torch's matmuls
    assert answer(kernel, "k", prompt) == answer(gathered, "g", prompt)


def test_bf16_pages_come_back_from_disk_byte_for_byte(model_dir, prompt, tmp_path):
    tier = {"num_blocks": 48, "disk_kv_bytes": 64 << 20, "kv_cache_dir": str(tmp_path / "kv")}
    first = engine_of(model_dir, **tier, **BF16)
    first_answer = answer(first, "a", prompt)
    blocks, _ = first.kv_cache.find_cached_prefix("probe", prompt)
    pages = first.executor.read_blocks([b.block_id for b in blocks])
    first.kv_cache.free("probe")
    assert len(blocks) == (len(prompt) - 1) // 16
    assert first.spill_prefix_cache() == (len(prompt) + 7) // 16  # with the answer's blocks (KV of 7 of its 8 tokens)
    restarted = engine_of(model_dir, **tier, **BF16)
    assert answer(restarted, "b", prompt) == first_answer
    assert restarted.kv_connector.offload.describe()["restored_blocks"] == len(blocks)
    blocks, _ = restarted.kv_cache.find_cached_prefix("probe", prompt)
    restored = restarted.executor.read_blocks([b.block_id for b in blocks])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(pages, restored, strict=True))
    fp32 = engine_of(model_dir, **tier)  # the same directory: none of those pages are its
    answer(fp32, "c", prompt)
    assert fp32.kv_connector.offload.describe()["restored_blocks"] == 0
