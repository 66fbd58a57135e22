"""Multimodal models in the engine (offline API): greedy parity with HF's own model classes,
media in the block hashes, the embedding cache, and a multimodal prefix restored from a lower tier."""

from __future__ import annotations

import json

import pytest

from cluster import LLM, SamplingParams
from cluster.engine.errors import InvalidRequestError
from tests.hf_reference import check_all
from tests.multimodal.conftest import FAMILIES, MAX_TOKENS
from tests.multimodal.models import image_conversations, png

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


@pytest.fixture(scope="module")
def llava(llava_dir):
    llm = LLM(llava_dir, num_blocks=128)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_answers_equal_hf_token_for_token(checkpoints, family):
    """One image, two images, an image in the second turn, text alone (and the same with audio
    clips, one of them at 8 kHz), all at once in one batch."""
    llm = LLM(checkpoints.dir(family), num_blocks=128)
    conversations = FAMILIES[family][2]()
    outputs = llm.chat(list(conversations.values()), GREEDY)
    check_all([o.outputs[0].token_ids for o in outputs], list(checkpoints.references(family).values()))
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_same_text_different_images_share_no_block_and_answer_differently(llava):
    pool = llava.engine.kv_cache.pool
    ask = lambda seed: [{"role": "user", "content": [  # noqa: E731
        {"type": "image", "data": png(seed)}, {"type": "text", "text": "What is in this picture?"}]}]
    first = llava.chat(ask(100), GREEDY)[0]
    hits_before = pool.stats.num_hit_tokens
    second = llava.chat(ask(101), GREEDY)[0]
    # the image starts at position 3, so even the first block holds some of it: nothing is shared
    assert pool.stats.num_hit_tokens == hits_before
    assert first.outputs[0].token_ids != second.outputs[0].token_ids
    misses = llava.engine.encoder.stats.cache_misses
    again = llava.chat(ask(100), GREEDY)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llava.engine.encoder.stats.cache_misses == misses  # encoded once
    assert pool.stats.num_hit_tokens - hits_before == 32  # 2 full blocks of the 40-token prompt


def test_a_placeholder_spelt_in_the_text_is_refused(llava):
    with pytest.raises(InvalidRequestError, match="<image>"):
        llava.chat([{"role": "user", "content": "look: <image>"}], GREEDY)
    assert llava.engine.num_free_blocks == llava.engine.num_blocks


def test_media_for_a_text_only_model_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="text only"):
        llm.engine.encode_media_prompt([{"role": "user", "content": [{"type": "image", "data": png(1)}]}])


def test_an_evicted_multimodal_prefix_comes_back_from_host_ram(llava_dir, llava_references):
    """12 blocks: the 180-token prompt that follows needs all of them, so the image prompt's two
    full blocks go down to host RAM; asked again, they come back (not recomputed) with the same answer,
    and the same text with another image restores nothing."""
    llm = LLM(llava_dir, num_blocks=12, host_kv_bytes=16 << 20)
    conversation = image_conversations()["one image"]
    first = llm.chat(conversation, GREEDY)[0].outputs[0].token_ids
    assert first == llava_references["one image"].token_ids
    llm.generate([list(range(1000, 1180))], SamplingParams(max_tokens=1))
    llm.engine.kv_connector.offload.flush()
    restored = llm.engine.kv_connector.offload.stats.restored_from
    assert llm.chat(conversation, GREEDY)[0].outputs[0].token_ids == first
    assert restored["host"] == 2
    other = [{"role": "user", "content": [{"type": "image", "data": png(7)}] + conversation[0]["content"][1:]}]
    llm.chat(other, GREEDY)
    assert restored["host"] == 2
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_pagoda_generate_offline_takes_images(llava_dir, llava_references, tmp_path):
    from tests.cluster.test_cli import run_in_process

    image = tmp_path / "picture.png"
    image.write_bytes(png(1))
    result = run_in_process("generate", "--offline", "--model", llava_dir, "--chat", "--image", str(image),
                            "--max-tokens", str(MAX_TOKENS), "--json", "What is in this picture?")
    assert result.exit_code == 0, result.output
    # stdout's last JSON line: the session's Ray cluster prints its workers' log lines into this
    # process (a Serve replica's access log once landed after the record)
    record = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert record["token_ids"] == llava_references["one image"].token_ids
    assert record["prompt"][0]["content"] == f"[--image {image}] What is in this picture?"
    text = tmp_path / "notes.txt"
    text.write_text("not a picture")
    result = run_in_process("generate", "--offline", "--model", llava_dir, "--chat", "--image", str(text), "Hi")
    assert result.exit_code == 1 and f"--image {text}: is not an image" in result.output
