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
from cluster.engine.sampling_params import SamplingParams
from tests.cache_service.test_page_codec import damage
from tests.model.test_kv_transfer import run_to_end
from tests.parity_prompts import DOC, DOC_B

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def answer(engine: LLMEngine, request_id: str, prompt: list[int]) -> list[int]:
    engine.add_request(request_id, prompt, GREEDY)
    tokens = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.new_token_ids
    return tokens


def small_engine(model_dir, tmp_path, host=True, disk=True) -> LLMEngine:
    # 48 blocks of 16 tokens: one 600-token prompt fits, a second one evicts the first's blocks
    return LLMEngine(EngineConfig(model=model_dir, num_blocks=48, max_num_batched_tokens=256,
                                  host_kv_bytes=(64 << 20) if host else 0, disk_kv_bytes=(256 << 20) if disk else 0,
                                  kv_cache_dir=str(tmp_path / "kv")))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    doc = tokenizer(DOC[:2400] + "\nSummarize the text above:").input_ids[-600:]
    others = [tokenizer(DOC_B[:2400]).input_ids[:600], tokenizer(DOC_B[3000:5400]).input_ids[:600]]
    return doc, others


@pytest.fixture(scope="module")
def cold(model_dir, prompts):
    engine = LLMEngine(EngineConfig(model=model_dir, num_blocks=64, enable_prefix_caching=False))
    return answer(engine, "cold", prompts[0])


def evict(engine, prompts):
    """Two other prompts need every block the doc's request held: its blocks are spilled, reused."""
    for i, other in enumerate(prompts[1]):
        answer(engine, f"other{i}", other)
    engine.kv_cache.offload.flush()
    assert engine.kv_cache.find_cached_prefix("probe", prompts[0]) == ([], 0)  # gone from device memory
    engine.kv_cache.free("probe")


def test_evicted_prefix_comes_back_from_host_ram(model_dir, tmp_path, prompts, cold):
    engine = small_engine(model_dir, tmp_path, disk=False)
    assert answer(engine, "first", prompts[0]) == cold
    evict(engine, prompts)
    assert answer(engine, "again", prompts[0]) == cold
    stats = engine.kv_cache.offload.describe()
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
    assert restarted.kv_cache.offload.describe()["restored_from"]["disk"] == len(prompts[0]) // 16


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
    stats = restarted.kv_cache.offload.describe()
    assert stats["restored_from"]["disk"] == 10  # the run before the damaged page; the rest recomputed
    assert stats["tiers"]["disk"]["bad_pages"] == {reason: 1}
    assert not victim.exists() and (tmp_path / "kv" / "quarantine" / victim.name).exists()


def test_two_engines_share_the_cache_service(server, model_dir, prompts, cold):
    """Two engines (as two replicas would) over the same CacheService shards: a prefix computed
    and evicted on one is restored on the other, with the cold run's answer."""
    import ray

    config = dict(model=model_dir, num_blocks=48, max_num_batched_tokens=256, host_kv_bytes=64 << 20,
                  kv_cache_service_shards=2)
    first, second = LLMEngine(EngineConfig(**config)), LLMEngine(EngineConfig(**config))
    shared = first.kv_cache.offload.tiers[0]
    try:
        assert answer(first, "first", prompts[0]) == cold
        assert first.spill_prefix_cache() >= len(prompts[0]) // 16
        assert answer(second, "second", prompts[0]) == cold
        assert second.kv_cache.offload.describe()["restored_from"]["service"] == len(prompts[0]) // 16
        pages = [shard["host"]["pages"] for shard in shared.describe_shards()]
        assert all(pages) and sum(pages) >= len(prompts[0]) // 16  # spread over both shards
    finally:
        for shard in shared.shards:
            ray.kill(shard)


def test_an_unwritable_disk_tier_degrades_to_recompute(model_dir, prompts, cold, caplog):
    """A disk tier that cannot be written turns itself off; requests still get the same answer."""
    engine = LLMEngine(EngineConfig(model=model_dir, num_blocks=48, max_num_batched_tokens=256,
                                    disk_kv_bytes=64 << 20, kv_cache_dir="/proc/pagoda-cannot-write-here"))
    assert answer(engine, "first", prompts[0]) == cold
    evict(engine, prompts)
    assert answer(engine, "again", prompts[0]) == cold
    disk = engine.kv_cache.offload.tiers[0]
    assert disk.enabled is False and "is off" in caplog.text
    assert engine.kv_cache.offload.describe()["failed_spills"] > 0


def test_write_through_survives_a_crash_without_any_eviction(model_dir, tmp_path, prompts, cold):
    """kv_write_through: every block goes down once computed, so an engine that dies with the
    document still in device memory (nothing evicted) leaves it on disk for the next one."""
    config = dict(model=model_dir, num_blocks=48, max_num_batched_tokens=256, disk_kv_bytes=256 << 20,
                  kv_cache_dir=str(tmp_path / "kv"), kv_write_through=True)
    engine = LLMEngine(EngineConfig(**config))
    assert answer(engine, "first", prompts[0]) == cold
    engine.kv_cache.offload.flush()
    assert engine.kv_cache.pool.num_cached_blocks >= len(prompts[0]) // 16  # still all in device memory
    del engine  # a crash: no drain, no eviction
    restarted = LLMEngine(EngineConfig(**config))
    assert answer(restarted, "again", prompts[0]) == cold
    restarted.kv_cache.offload.flush()
    stats = restarted.kv_cache.offload.describe()
    assert stats["restored_from"]["disk"] == len(prompts[0]) // 16
    assert stats["spilled_blocks"] == 0  # restored (and re-computed identical) blocks are not written again


def test_a_tp2_engine_spills_and_restores_pages_that_a_tp1_engine_can_use(server, model_dir, tmp_path, prompts, cold):
    """A TP=2 group's pages hold every KV head (joined from its ranks), so it restores its own
    and a TP=1 engine on the same directory restores them too, each with the cold run's answer."""
    config = dict(model=model_dir, num_blocks=48, max_num_batched_tokens=256, disk_kv_bytes=256 << 20,
                  kv_cache_dir=str(tmp_path / "kv"))
    tp2 = LLMEngine(EngineConfig(**config, tensor_parallel_size=2))
    try:
        assert answer(tp2, "first", prompts[0]) == cold
        evict(tp2, prompts)
        assert answer(tp2, "again", prompts[0]) == cold
        assert tp2.kv_cache.offload.describe()["restored_from"]["disk"] == len(prompts[0]) // 16
    finally:
        tp2.runner.shutdown()
    tp1 = LLMEngine(EngineConfig(**config))
    assert answer(tp1, "tp1", prompts[0]) == cold
    assert tp1.kv_cache.offload.describe()["restored_from"]["disk"] == len(prompts[0]) // 16


def test_a_prefill_engine_exports_the_blocks_it_restored(model_dir, tmp_path, prompts, cold):
    """Disaggregation over the tiers: the prefill side restores the document from host RAM and
    its export (which starts at position 0) carries the restored blocks to the decode side."""
    prefill = small_engine(model_dir, tmp_path, disk=False)
    answer(prefill, "first", prompts[0])
    evict(prefill, prompts)
    prefill.add_request("doc", prompts[0], dataclasses.replace(GREEDY, max_tokens=1), export_kv=True)
    (last,) = run_to_end(prefill)["doc"]
    assert prefill.kv_cache.offload.describe()["restored_from"]["host"] == len(prompts[0]) // 16
    decode = LLMEngine(EngineConfig(model=model_dir, num_blocks=64))
    first = decode.add_request("doc", prompts[0], GREEDY, prefilled=last.prefilled)
    assert [first[0].new_token_ids[0]] + [d.new_token_ids[0] for d in run_to_end(decode)["doc"]] == cold


def test_a_dead_cache_service_shard_is_a_miss_not_an_error(server, model_dir, prompts, cold):
    """A shard killed under the engine: lookups and spills that touch it miss (logged, counted),
    the answer stays the cold run's, and the shard is started again and used from then on."""
    import ray

    config = dict(model=model_dir, num_blocks=48, max_num_batched_tokens=256, host_kv_bytes=64 << 20,
                  kv_cache_service_shards=2)
    engine = LLMEngine(EngineConfig(**config))
    shared = engine.kv_cache.offload.tiers[0]
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
