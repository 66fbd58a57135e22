"""Greedy outputs equal HF transformers token for token on the real default model: run
concurrently, with chunked prefill forced small, with prefix-cache hits, and under preemption."""

import pytest

from cluster import LLM, SamplingParams
from tests.cluster.factories import block_bytes
from tests.conftest import PARITY_MAX_TOKENS
from tests.hf_reference import check_all
from tests.parity_prompts import parity_prompts, without_long_twins

GREEDY = SamplingParams(max_tokens=PARITY_MAX_TOKENS, temperature=0)


def test_tokenization_is_hf(llm, tokenizer, encoded):
    prompts = parity_prompts()
    assert len(prompts) >= 20
    assert encoded[8] == tokenizer(prompts[8]["prompt"])["input_ids"]
    assert max(len(ids) for ids in encoded) > 2048


def test_concurrent_greedy_matches_hf(llm, encoded, references):
    check_all([o.outputs[0].token_ids for o in llm.generate(encoded, GREEDY)], references)


# A group of its own (the module's fixtures are all the session's): one of the module's two longest
# tests runs beside the other, on the other pytest worker.
@pytest.mark.xdist_group("parity-small-chunks")
def test_small_prefill_chunks_match_hf(model_dir, encoded, references):
    # 48-token chunks take ~45 steps per 2.1K-token document: one of them crosses enough boundaries
    chosen = without_long_twins()
    chunked = LLM(model_dir, num_blocks=1024, max_num_batched_tokens=48)
    outputs = chunked.generate([encoded[i] for i in chosen], GREEDY)
    check_all([o.outputs[0].token_ids for o in outputs], [references[i] for i in chosen])
    assert chunked.engine.num_free_blocks == chunked.engine.num_blocks


def test_prefix_cache_hits_match_hf(llm, encoded, references):
    stats = llm.engine.kv_cache.pool.stats
    llm.generate(encoded, GREEDY)  # warm the cache (the test order does not matter)
    hits_before = stats.num_hit_tokens
    outputs = llm.generate(encoded, GREEDY)
    # every long prompt is served from the cache but for its last partial block
    assert stats.num_hit_tokens - hits_before >= sum(len(ids) - 16 for ids in encoded if len(ids) > 2000)
    check_all([o.outputs[0].token_ids for o in outputs], references)
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("mode, swap_blocks, host_tier_blocks", [
    ("recompute", 0, 0), ("swap", 1000, 0), ("swap", 1, 0),
    ("swap", 0, 1000),  # swap copies drawn from the host tier's budget (swap_space_bytes is not used)
])
def test_preempted_requests_still_match_hf(model_dir, encoded, references, mode, swap_blocks, host_tier_blocks):
    short = [i for i, ids in enumerate(encoded) if len(ids) < 100]
    # 12 blocks of 16 tokens cannot hold every short request's context at once
    tight = LLM(model_dir, num_blocks=12, preemption_mode=mode, enable_prefix_caching=mode == "recompute",
                swap_space_bytes=swap_blocks * block_bytes(model_dir),
                host_kv_bytes=host_tier_blocks * block_bytes(model_dir))
    outputs = tight.generate([encoded[i] for i in short], GREEDY)
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0
    if host_tier_blocks:  # every copy came out of the host tier's budget and went back to it
        assert stats.num_swapped_in == stats.num_preemptions
        assert tight.engine.kv_connector.offload.describe()["tiers"]["host"]["reserved_bytes"] == 0
    elif swap_blocks == 1000:  # every preempted request came back from host memory (no prefix cache to help it)
        assert stats.num_swapped_in == stats.num_preemptions
    elif swap_blocks == 1:  # swap space for one block: a request holding more was recomputed instead
        assert 0 < stats.num_swapped_in < stats.num_preemptions
    else:
        assert stats.num_swapped_in == 0
    check_all([o.outputs[0].token_ids for o in outputs], [references[i] for i in short])
    assert stats.num_swapped_blocks == 0
    if not host_tier_blocks:
        assert tight.engine.kv_connector.swap_space.used_blocks == 0  # every copy's room given back
    assert tight.engine.num_free_blocks == 12

