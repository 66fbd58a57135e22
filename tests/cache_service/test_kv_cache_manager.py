from cache_service import KVCacheManager


def make_manager(num_blocks=8, block_size=4):
    return KVCacheManager(num_blocks, block_size, "test-model")


def test_allocate_grows_block_table_as_tokens_arrive():
    kv = make_manager()
    assert kv.allocate_slots("a", 5)
    assert kv.block_ids("a") == [0, 1]
    assert kv.allocate_slots("a", 8)  # still fits in two blocks
    assert kv.block_ids("a") == [0, 1]
    assert kv.allocate_slots("a", 9)
    assert kv.block_ids("a") == [0, 1, 2]
    kv.free("a")
    assert kv.num_free_blocks == 8


def test_allocation_failure_changes_nothing():
    kv = make_manager(num_blocks=2)
    assert kv.allocate_slots("a", 4)
    assert not kv.allocate_slots("b", 9)
    assert kv.num_free_blocks == 1 and kv.block_ids("b") == []


def test_prefix_hit_shares_blocks_and_leaves_last_token_to_compute():
    kv = make_manager()
    tokens = list(range(12))  # exactly three full blocks
    assert kv.find_cached_prefix("a", tokens) == ([], 0)
    kv.allocate_slots("a", 12)
    kv.cache_full_blocks("a", tokens, 12)
    hits, num_hit = kv.find_cached_prefix("b", tokens)
    # the last block is not served: the model must compute at least the last token
    assert [b.block_id for b in hits] == [0, 1] and num_hit == 8
    assert kv.allocate_slots("b", 12, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.num_free_blocks == 4
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8


def test_freed_request_blocks_stay_cached_and_are_evicted_tail_first():
    kv = make_manager(num_blocks=4)
    tokens = list(range(16))
    kv.allocate_slots("a", 16)
    kv.cache_full_blocks("a", tokens, 16)
    kv.free("a")  # frees 3, 2, 1, 0 in that order
    assert kv.allocate_slots("b", 4)
    assert kv.block_ids("b") == [3]  # the tail block goes first
    hits, num_hit = kv.find_cached_prefix("c", tokens + [99])
    assert [b.block_id for b in hits] == [0, 1, 2] and num_hit == 12


def test_only_computed_full_blocks_are_cached():
    kv = make_manager()
    tokens = list(range(10))
    kv.allocate_slots("a", 10)
    kv.cache_full_blocks("a", tokens, 6)  # one full computed block
    hits, _ = kv.find_cached_prefix("b", tokens)
    assert [b.block_id for b in hits] == [0]


def test_salt_separates_tenants():
    kv = make_manager()
    tokens = list(range(9))
    kv.allocate_slots("a", 9, salt="t1")
    kv.cache_full_blocks("a", tokens, 9)
    assert kv.find_cached_prefix("b", tokens, salt="t2") == ([], 0)
    assert kv.find_cached_prefix("c", tokens, salt="t1")[1] == 8
