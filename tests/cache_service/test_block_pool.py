import pytest

from cache_service import BlockPool, hash_block_tokens, root_hash
from cache_service.hashing import hash_full_blocks

ROOT = root_hash("test-model")


def test_allocate_takes_lowest_free_ids_in_order():
    pool = BlockPool(4)
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 1
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_free_returns_blocks_in_lru_order():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.free([c, a])
    pool.free([d])
    assert [blk.block_id for blk in pool.allocate(3)] == [2, 0, 3]


def test_shared_block_is_free_only_after_last_reference():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])
    pool.free([block])
    assert pool.num_free_blocks == 1
    pool.free([block])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.free([block])


def test_cached_block_hits_until_evicted_by_reuse():
    pool = BlockPool(2)
    tokens = tuple(range(4))
    h = hash_block_tokens(ROOT, tokens)
    (block,) = pool.allocate(1)
    pool.cache_block(block, h, tokens)
    pool.free([block])
    assert pool.get_cached_block(h, tokens) is block  # freed but still cached
    pool.touch([block])
    assert pool.num_free_blocks == 1 and block.ref_cnt == 1
    pool.free([block])
    pool.allocate(1)  # block 1 (free longer) goes first
    assert pool.get_cached_block(h, tokens) is block
    pool.allocate(1)  # now block 0 is reused: its hash is evicted
    assert pool.get_cached_block(h, tokens) is None
    assert pool.stats.num_evicted_blocks == 1


def test_hit_checks_token_ids_not_just_the_hash():
    pool = BlockPool(1)
    (block,) = pool.allocate(1)
    h = hash_block_tokens(ROOT, (1, 2))
    pool.cache_block(block, h, (1, 2))
    assert pool.get_cached_block(h, (1, 3)) is None


def test_hash_chains_cover_parent_model_and_salt():
    a = hash_full_blocks([1, 2, 3, 4, 5], 2, ROOT)
    assert len(a) == 2  # only full blocks
    assert a[1] == hash_block_tokens(a[0], (3, 4))
    assert hash_full_blocks([9, 9, 3, 4], 2, ROOT)[1] != a[1]  # same block, other parent
    assert hash_full_blocks([1, 2], 2, root_hash("other-model"))[0] != a[0]
    assert hash_full_blocks([1, 2], 2, root_hash("test-model", salt="tenant"))[0] != a[0]


def test_disabled_prefix_caching_never_caches():
    pool = BlockPool(1, enable_prefix_caching=False)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h", (1,))
    assert pool.get_cached_block(b"h", (1,)) is None
