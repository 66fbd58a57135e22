"""The engine over the lower KV tiers, on the real model: a prompt whose blocks were evicted from
device memory is restored from host RAM or from disk (also by a new engine on the same directory,
as after a restart) instead of recomputed, and answers exactly as a cold run; a damaged page on
disk (flipped byte, truncated, empty, bad LZ4 frame) is detected and recomputed with the same answer."""

import dataclasses
import shutil

import pytest

from cache_service.hashing import hash_full_blocks, root_hash
from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.executor.factory import build_engine
from cluster.engine.sampling_params import SamplingParams
from tests.cache_service.test_page_codec import damage
from tests.model.test_kv_transfer import run_to_end
from tests.parity_prompts import DOC, DOC_B

GREEDY = SamplingParams(max_tokens=8, temperature=0)
# Device memory of 24 blocks of 16 tokens: one 300-token prompt (two prefill chunks of at most 256)
# fits, and two others need every block it held. The prompts' length is the tests' cost: each is
# prefilled several times.
BLOCKS, PROMPT_TOKENS = 24, 300


def answer(engine: LLMEngine, request_id: str, prompt: list[int]) -> list[int]:
    engine.add_request(request_id, prompt, GREEDY)
    tokens = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.new_token_ids
    return tokens


def small_engine(model_dir, tmp_path, host=True, disk=True) -> LLMEngine:
    return build_engine(EngineConfig(model=model_dir, num_blocks=BLOCKS, max_num_batched_tokens=256,
                                  host_kv_bytes=(64 << 20) if host else 0, disk_kv_bytes=(256 << 20) if disk else 0,
                                  kv_cache_dir=str(tmp_path / "kv")))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    doc = tokenizer(DOC[:2400] + "\nSummarize the text above:").input_ids[-PROMPT_TOKENS:]
    others = [tokenizer(DOC_B[:2400]).input_ids[:PROMPT_TOKENS], tokenizer(DOC_B[3000:5400]).input_ids[:PROMPT_TOKENS]]
    return doc, others


@pytest.fixture(scope="module")
def cold(model_dir, prompts):
    engine = build_engine(EngineConfig(model=model_dir, num_blocks=64, enable_prefix_caching=False))
    return answer(engine, "cold", prompts[0])


def evict(engine, prompts):
    """Two other prompts need every block the doc's request held: its blocks are spilled, reused."""
    for i, other in enumerate(prompts[1]):
        answer(engine, f"other{i}", other)
    engine.kv_connector.offload.flush()
    assert engine.kv_cache.find_cached_prefix("probe", prompts[0]) == ([], 0)  # gone from device memory
    engine.kv_cache.free("probe")


def test_evicted_prefix_comes_back_from_host_ram(model_dir, tmp_path, prompts, cold):
    engine = small_engine(model_dir, tmp_path, disk=False)
    assert answer(engine, "first", prompts[0]) == cold
    evict(engine, prompts)
    assert answer(engine, "again", prompts[0]) == cold
    stats = engine.kv_connector.offload.describe()
    assert stats["restored_from"]["host"] == len(prompts[0]) // 16 and stats["spilled_blocks"] > 0
    # the restore came from the prefetch started when the request arrived (waited for or not)
    assert stats["prefetch_on_time"] + stats["prefetch_late"] == 1 and stats["prefetch_stale"] == 0
    assert engine.num_free_blocks == engine.num_blocks


def test_evicted_prefix_comes_back_from_disk_after_a_restart(model_dir, tmp_path, prompts, cold):
    engine = small_engine(model_dir, tmp_path)
    answer(engine, "first", prompts[0])
    evict(engine, prompts)
    del engine
    restarted = small_engine(model_dir, tmp_path, host=False)  # nothing in memory: only the files
    assert answer(restarted, "again", prompts[0]) == cold
    assert restarted.kv_connector.offload.describe()["restored_from"]["disk"] == len(prompts[0]) // 16


@pytest.fixture(scope="module")
def spilled_pages(model_dir, tmp_path_factory, prompts):
    """A disk tier holding the doc's pages, left by an engine that is gone (pristine: copy it)."""
    home = tmp_path_factory.mktemp("spilled")
    engine = small_engine(model_dir, home)
    answer(engine, "first", prompts[0])
    evict(engine, prompts)
    return home / "kv", hash_full_blocks(prompts[0], 16, root_hash(engine.kv_cache.model_identity))


@pytest.mark.parametrize("kind, reason", [
    ("flipped_payload_byte", "checksum"), ("truncated", "truncated"), ("zero_length", "truncated"),
    ("bad_lz4_frame", "codec"),
])
def test_a_damaged_page_on_disk_is_recomputed_with_the_same_answer(model_dir, tmp_path, prompts, cold,
                                                                    spilled_pages, kind, reason):
    pages, doc_hashes = spilled_pages
    shutil.copytree(pages, tmp_path / "kv")
    victim = tmp_path / "kv" / f"{doc_hashes[10].hex()}.page"  # the doc's 11th block
    victim.write_bytes(damage(victim.read_bytes(), kind))
    restarted = small_engine(model_dir, tmp_path, host=False)
    assert answer(restarted, "again", prompts[0]) == cold
    stats = restarted.kv_connector.offload.describe()
    assert stats["restored_from"]["disk"] == len(prompts[0]) // 16 - 1  # all but the damaged page
    assert stats["tiers"]["disk"]["bad_pages"] == {reason: 1}
    assert not victim.exists() and (tmp_path / "kv" / "quarantine" / victim.name).exists()


def count_computed_tokens(engine) -> list[int]:
    """Wraps the runner: the returned list grows by each step's computed token count."""
    counts, execute = [], engine.executor.execute
    engine.executor.execute = lambda seqs: counts.append(sum(len(s.new_token_ids) for s in seqs)) or execute(seqs)
    return counts


def test_a_page_missing_from_the_middle_costs_one_blocks_recompute(model_dir, tmp_path, prompts, cold, spilled_pages):
    """No hole hides the rest: the blocks after a missing page are restored, only it is computed."""
    pages, doc_hashes = spilled_pages
    shutil.copytree(pages, tmp_path / "kv")
    (tmp_path / "kv" / f"{doc_hashes[10].hex()}.page").unlink()
    restarted = small_engine(model_dir, tmp_path, host=False)
    computed = count_computed_tokens(restarted)
    assert answer(restarted, "again", prompts[0]) == cold
    assert restarted.kv_connector.offload.describe()["restored_from"]["disk"] == len(prompts[0]) // 16 - 1
    # the hole's 16 tokens, the tail after the last full block before the final token, 7 decodes
    tail = len(prompts[0]) - (len(prompts[0]) - 1) // 16 * 16
    assert sum(computed) == 16 + tail + 7


@pytest.fixture(scope="module")
def chat_prompts(tokenizer):
    """A chat document and two other chats: the model's template puts the same system prompt in
    front of each, so their first block is shared and stays in device memory."""
    def chat(text):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]

    doc = chat(DOC[:2000] + "\nSummarize the text above.")[:PROMPT_TOKENS]
    return doc, [chat(DOC_B[:2200])[:PROMPT_TOKENS], chat(DOC_B[3000:5200])[:PROMPT_TOKENS]]


def test_a_chat_document_comes_back_whole_after_a_crash(model_dir, tmp_path, chat_prompts):
    """The shared head (system prompt) is never evicted, but it is written down once when a second
    request first shares it: after a crash (no drain) a new engine restores every block."""
    cold_engine = build_engine(EngineConfig(model=model_dir, num_blocks=64, enable_prefix_caching=False))
    cold_answer = answer(cold_engine, "cold", chat_prompts[0])
    engine = small_engine(model_dir, tmp_path)
    answer(engine, "first", chat_prompts[0])
    for i, other in enumerate(chat_prompts[1]):
        answer(engine, f"other{i}", other)
    engine.kv_connector.offload.flush()
    cached, _ = engine.kv_cache.find_cached_prefix("probe", chat_prompts[0])
    assert len(cached) == 1  # only the shared head is still in device memory
    del engine  # a crash: nothing more is moved down
    restarted = small_engine(model_dir, tmp_path, host=False)
    assert answer(restarted, "again", chat_prompts[0]) == cold_answer
    assert restarted.kv_connector.offload.describe()["restored_from"]["disk"] == (len(chat_prompts[0]) - 1) // 16


def test_blocks_are_written_down_once_when_first_shared(model_dir, tmp_path, prompts):
    engine = small_engine(model_dir, tmp_path, disk=False)
    head = prompts[0][:64]
    answer(engine, "a", head + [11] * 20)
    engine.kv_connector.offload.flush()
    assert engine.kv_connector.offload.stats.spilled_blocks == 0  # cached, not shared yet
    answer(engine, "b", head + [12] * 20)  # shares the 4 blocks of the head
    answer(engine, "c", head + [13] * 20)  # shares them again: nothing more to write
    engine.kv_connector.offload.flush()
    assert engine.kv_connector.offload.stats.spilled_blocks == 4


def test_pages_of_other_weights_are_never_used(tmp_path, model_dir):
    """Two checkpoints of the same config in directories of the same name (a fine-tune, a new
    revision in place) on one disk tier: the second computes its own KV and its own answer."""
    from tests.model.test_tiny_models import ARCHITECTURES, save_tiny_model

    paths = [save_tiny_model(*ARCHITECTURES["llama3"], tmp_path / name / "tiny", model_dir, seed)[0]
             for name, seed in (("a", 0), ("b", 1))]
    prompt = list(range(100, 300))
    config = dict(num_blocks=32, max_num_batched_tokens=256, disk_kv_bytes=64 << 20, kv_cache_dir=str(tmp_path / "kv"))
    first = build_engine(EngineConfig(model=paths[0], **config))
    first_answer = answer(first, "a", prompt)
    assert first.spill_prefix_cache() == (len(prompt) - 1) // 16  # its pages are on disk
    second = build_engine(EngineConfig(model=paths[1], **config))
    second_answer = answer(second, "b", prompt)
    assert second.kv_connector.offload.describe()["restored_blocks"] == 0
    alone = build_engine(EngineConfig(model=paths[1], num_blocks=32, enable_prefix_caching=False))
    assert second_answer == answer(alone, "alone", prompt) != first_answer
    assert first.model_identity != second.model_identity


def test_two_engines_share_the_cache_service(server, model_dir, prompts, cold):
    """Two engines (as two replicas would) over the same CacheService shards: a prefix computed
    and evicted on one is restored on the other, with the cold run's answer."""
    import ray

    config = dict(model=model_dir, num_blocks=BLOCKS, max_num_batched_tokens=256, host_kv_bytes=64 << 20,
                  kv_cache_service_shards=2)
    first, second = build_engine(EngineConfig(**config)), build_engine(EngineConfig(**config))
    shared = first.kv_connector.offload.tiers[0]
    try:
        assert answer(first, "first", prompts[0]) == cold
        assert first.spill_prefix_cache() >= len(prompts[0]) // 16
        assert answer(second, "second", prompts[0]) == cold
        assert second.kv_connector.offload.describe()["restored_from"]["service"] == len(prompts[0]) // 16
        pages = [shard["host"]["pages"] for shard in shared.describe_shards()]
        assert all(pages) and sum(pages) >= len(prompts[0]) // 16  # spread over both shards
    finally:
        for shard in shared.shards:
            ray.kill(shard)


def test_a_second_engine_restores_a_chat_document_from_the_cache_service(server, model_dir, chat_prompts):
    """A chat document computed on one engine (as one replica), pushed out of its device memory by
    other chats: its shared head was never evicted but went down when first shared, so a second
    engine over the same CacheService restores every block of it."""
    import ray

    config = dict(model=model_dir, num_blocks=BLOCKS, max_num_batched_tokens=256, host_kv_bytes=64 << 20,
                  kv_cache_service_shards=2)
    first, second = build_engine(EngineConfig(**config)), build_engine(EngineConfig(**config))
    shared = first.kv_connector.offload.tiers[0]
    try:
        first_answer = answer(first, "first", chat_prompts[0])
        for i, other in enumerate(chat_prompts[1]):
            answer(first, f"other{i}", other)
        first.kv_connector.offload.flush()
        assert answer(second, "second", chat_prompts[0]) == first_answer
        assert second.kv_connector.offload.describe()["restored_from"]["service"] == (len(chat_prompts[0]) - 1) // 16
    finally:
        for shard in shared.shards:
            ray.kill(shard)


def test_an_unwritable_disk_tier_degrades_to_recompute(model_dir, prompts, cold, caplog):
    """A disk tier that cannot be written turns itself off; requests still get the same answer."""
    engine = build_engine(EngineConfig(model=model_dir, num_blocks=BLOCKS, max_num_batched_tokens=256,
                                    disk_kv_bytes=64 << 20, kv_cache_dir="/proc/pagoda-cannot-write-here"))
    assert answer(engine, "first", prompts[0]) == cold
    evict(engine, prompts)
    assert answer(engine, "again", prompts[0]) == cold
    disk = engine.kv_connector.offload.tiers[0]
    assert disk.enabled is False and "is off" in caplog.text
    assert engine.kv_connector.offload.describe()["failed_spills"] > 0


def test_write_through_survives_a_crash_without_any_eviction(model_dir, tmp_path, prompts, cold):
    """kv_write_through: every block goes down once computed, so an engine that dies with the
    document still in device memory (nothing evicted) leaves it on disk for the next one."""
    config = dict(model=model_dir, num_blocks=BLOCKS, max_num_batched_tokens=256, disk_kv_bytes=256 << 20,
                  kv_cache_dir=str(tmp_path / "kv"), kv_write_through=True)
    engine = build_engine(EngineConfig(**config))
    assert answer(engine, "first", prompts[0]) == cold
    engine.kv_connector.offload.flush()
    assert engine.kv_cache.pool.num_cached_blocks >= len(prompts[0]) // 16  # still all in device memory
    del engine  # a crash: no drain, no eviction
    restarted = build_engine(EngineConfig(**config))
    assert answer(restarted, "again", prompts[0]) == cold
    restarted.kv_connector.offload.flush()
    stats = restarted.kv_connector.offload.describe()
    assert stats["restored_from"]["disk"] == len(prompts[0]) // 16
    assert stats["spilled_blocks"] == 0  # restored (and re-computed identical) blocks are not written again


def test_a_tp2_engine_spills_and_restores_pages_that_a_tp1_engine_can_use(server, model_dir, tmp_path, prompts, cold):
    """A TP=2 group's pages hold every KV head (joined from its ranks), so it restores its own
    and a TP=1 engine on the same directory restores them too, each with the cold run's answer."""
    config = dict(model=model_dir, num_blocks=BLOCKS, max_num_batched_tokens=256, disk_kv_bytes=256 << 20,
                  kv_cache_dir=str(tmp_path / "kv"))
    tp2 = build_engine(EngineConfig(**config, tensor_parallel_size=2, tp_collective="gloo"))  # see TP2 in test_disaggregated_serving
    try:
        assert answer(tp2, "first", prompts[0]) == cold
        evict(tp2, prompts)
        assert answer(tp2, "again", prompts[0]) == cold
        assert tp2.kv_connector.offload.describe()["restored_from"]["disk"] == len(prompts[0]) // 16
    finally:
        tp2.executor.shutdown()
    tp1 = build_engine(EngineConfig(**config))
    assert answer(tp1, "tp1", prompts[0]) == cold
    assert tp1.kv_connector.offload.describe()["restored_from"]["disk"] == len(prompts[0]) // 16


def test_a_prefill_engine_exports_the_blocks_it_restored(model_dir, tmp_path, prompts, cold):
    """Disaggregation over the tiers: the prefill side restores the document from host RAM and
    its export (which starts at position 0) carries the restored blocks to the decode side."""
    prefill = small_engine(model_dir, tmp_path, disk=False)
    answer(prefill, "first", prompts[0])
    evict(prefill, prompts)
    prefill.add_request("doc", prompts[0], dataclasses.replace(GREEDY, max_tokens=1), export_kv=True)
    (last,) = run_to_end(prefill)["doc"]
    assert prefill.kv_connector.offload.describe()["restored_from"]["host"] == len(prompts[0]) // 16
    decode = build_engine(EngineConfig(model=model_dir, num_blocks=64))
    first = decode.add_request("doc", prompts[0], GREEDY, prefilled=last.prefilled)
    assert [first[0].new_token_ids[0]] + [d.new_token_ids[0] for d in run_to_end(decode)["doc"]] == cold


def test_a_dead_cache_service_shard_is_a_miss_not_an_error(server, model_dir, prompts, cold):
    """A shard killed under the engine: lookups and spills that touch it miss (logged, counted),
    the answer stays the cold run's, and the shard is started again and used from then on."""
    import ray

    config = dict(model=model_dir, num_blocks=BLOCKS, max_num_batched_tokens=256, host_kv_bytes=64 << 20,
                  kv_cache_service_shards=2)
    engine = build_engine(EngineConfig(**config))
    shared = engine.kv_connector.offload.tiers[0]
    try:
        assert answer(engine, "first", prompts[0]) == cold
        engine.spill_prefix_cache()
        ray.kill(shared.shards[0])  # its host pages go with it
        assert answer(engine, "again", prompts[0]) == cold
        stats = shared.describe()
        assert stats["shard_failures"] >= 1 and all("error" not in shard for shard in stats["shards"])
        assert engine.spill_prefix_cache() > 0  # both shards take pages again
        assert all(shard["host"]["pages"] > 0 for shard in shared.describe_shards())
        assert engine.num_free_blocks == engine.num_blocks
    finally:
        for shard in shared.shards:
            ray.kill(shard)
