"""BlockPool and the free list: null block, LRU eviction order, O(1) removal on cache hits, hashing."""

from __future__ import annotations

import pytest

from vllm_lite.core.block_pool import BlockPool
from vllm_lite.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
    update_request_block_hashes,
)
from vllm_lite.core.request import Request
from vllm_lite.sampling_params import SamplingParams


def _hashes(n: int) -> list[bytes]:
    out, parent = [], None
    for i in range(n):
        parent = hash_block_tokens(parent, [i, i + 1])
        out.append(parent)
    return out


def test_null_block_is_block_zero_and_never_handed_out():
    pool = BlockPool(5)
    assert pool.null_block is not None and pool.null_block.block_id == 0
    assert pool.num_usable_blocks == 4
    got = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in got) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)


def test_pool_without_null_block_uses_every_id():
    pool = BlockPool(3, enable_caching=False, reserve_null_block=False)
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]


def test_invalid_sizes_raise_value_error():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(4).get_new_blocks(-1)


def test_get_new_blocks_takes_from_head_and_counts_refs():
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [1, 2]
    assert all(b.ref_cnt == 1 for b in a)
    assert pool.get_num_free_blocks() == 3
    assert pool.get_usage() == pytest.approx(2 / 5)


def test_free_appends_in_given_order_so_reverse_frees_evict_tails_first():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(5)  # ids 1..5
    pool.free_blocks(reversed(blocks[:3]))  # a request freeing its chain 1,2,3 tail first
    free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert free_ids == [3, 2, 1]
    # The next allocation evicts block 3 (the chain's tail) before its prefix.
    assert pool.get_new_blocks(1)[0].block_id == 3


def test_double_free_raises():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([b])


def test_cached_free_block_hit_is_removed_from_middle_of_free_list():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(5)
    hashes = _hashes(5)
    pool.cache_full_blocks(blocks, hashes, 0, 5)
    pool.free_blocks(blocks)  # free order 1..5, all still cached
    hit = pool.get_cached_block(hashes[2])
    assert hit is blocks[2] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [1, 2, 4, 5]
    assert pool.get_num_free_blocks() == 4
    # Touching an in-use block only bumps its count.
    pool.touch([hit])
    assert hit.ref_cnt == 2 and pool.get_num_free_blocks() == 4


def test_reusing_a_cached_block_evicts_its_hash():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    hashes = _hashes(2)
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.free_blocks(blocks)
    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[0] and reused.block_hash is None
    assert pool.get_cached_block(hashes[0]) is None
    assert pool.get_cached_block(hashes[1]) is blocks[1]


def test_lru_eviction_prefers_least_recently_freed():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    hashes = _hashes(3)
    pool.cache_full_blocks([a, b, c], hashes, 0, 3)
    pool.free_blocks([b])
    pool.free_blocks([a])
    pool.free_blocks([c])
    # Re-hit a: it leaves the list and goes back to the tail when freed again.
    pool.touch([a])
    pool.free_blocks([a])
    order = [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()]
    assert order == [b.block_id, c.block_id, a.block_id]
    assert [x.block_id for x in pool.get_new_blocks(2)] == [b.block_id, c.block_id]
    assert pool.get_cached_block(hashes[0]) is a


def test_duplicate_hash_keeps_first_block_cached_only():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = _hashes(1)
    pool.cache_full_blocks([a], h, 0, 1)
    pool.cache_full_blocks([b], h, 0, 1)
    assert pool.get_cached_block(h[0]) is a
    assert b.block_hash is None


def test_caching_disabled_never_registers_hashes():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, _hashes(2), 0, 2)
    assert pool.cached_block_hash_to_block == {}


def test_reset_prefix_cache_refused_while_blocks_in_use_then_clears():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    hashes = _hashes(2)
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in blocks)


def test_free_queue_remove_and_append_errors():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[1])
    with pytest.raises(ValueError, match="not in the free list"):
        q.remove(blocks[1])
    with pytest.raises(ValueError, match="already in the free list"):
        q.append(blocks[0])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 2]
    assert q.popleft().block_id == 0 and q.popleft().block_id == 2
    with pytest.raises(ValueError):
        q.popleft()


def test_block_hash_chains_parent_tokens_and_extra_keys():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert h1 == hash_block_tokens(None, [1, 2, 3])
    assert len(h1) == 32
    assert h1 != hash_block_tokens(None, [1, 2, 4])
    assert h1 != hash_block_tokens(None, [1, 2, 3], ("salt", "x"))
    assert hash_block_tokens(h1, [4]) != hash_block_tokens(hash_block_tokens(None, [9, 9, 9]), [4])


def test_request_block_hashes_grow_incrementally_and_salt_changes_chain():
    sp = SamplingParams(max_tokens=4)
    r = Request("a", list(range(10)), sp, None, 0.0)
    assert len(update_request_block_hashes(r, 4)) == 2
    r.append_output_token_ids([10, 11])
    assert len(update_request_block_hashes(r, 4)) == 3
    fresh = Request("b", list(range(12)), sp, None, 0.0)
    assert update_request_block_hashes(fresh, 4) == r.block_hashes
    salted = Request("c", list(range(12)), sp, None, 0.0, cache_salt="s")
    salted_hashes = update_request_block_hashes(salted, 4)
    assert all(x != y for x, y in zip(salted_hashes, r.block_hashes))


# --------------------------------------------------------------- edges found by mutation testing (docs/MUTATION.md)
def test_size_errors_say_what_is_needed():
    with pytest.raises(ValueError, match=r"at least 2 \(block 0 is the null block\), got 1\."):
        BlockPool(1)
    with pytest.raises(ValueError, match=r"must be an integer, non-negative, got -1\."):
        BlockPool(-1, reserve_null_block=False)


def test_smallest_pools_work():
    pool = BlockPool(2)  # the null block plus one usable block
    assert pool.num_usable_blocks == 1 and [b.block_id for b in pool.get_new_blocks(1)] == [1]
    empty = BlockPool(0, enable_caching=False, reserve_null_block=False)
    assert empty.null_block is None and empty.num_usable_blocks == 0
    assert empty.get_usage() == 0.0
    assert BlockPool(3, reserve_null_block=False).num_usable_blocks == 3


def test_get_zero_blocks_is_empty_not_an_error():
    pool = BlockPool(3)
    assert pool.get_new_blocks(0) == []
    assert pool.get_num_free_blocks() == 2


def test_null_block_is_marked_and_never_joins_the_free_list():
    pool = BlockPool(4)
    null = pool.null_block
    assert null is not None and null.is_null is True
    pool.touch([null])  # a request's placeholder entries take and drop references like any block
    pool.free_blocks([null])
    assert null not in pool.free_block_queue.get_all_free_blocks()
    assert pool.get_num_free_blocks() == 3
    # A null entry in a request's block list is never registered under a hash.
    (b,) = pool.get_new_blocks(1)
    hashes = _hashes(2)
    pool.cache_full_blocks([null, b], hashes, 0, 2)
    assert null.block_hash is None and pool.get_cached_block(hashes[0]) is None
    assert pool.get_cached_block(hashes[1]) is b


def test_cache_full_blocks_registers_only_the_new_range_and_skips_past_taken_ones():
    pool = BlockPool(8)
    a, b, c, d = pool.get_new_blocks(4)
    hashes = _hashes(4)
    # Blocks before num_cached are left alone, even when uncached.
    pool.cache_full_blocks([a, b], hashes, 1, 2)
    assert a.block_hash is None and b.block_hash == hashes[1]
    # An already-hashed block and a duplicate hash are skipped, not the end of the range.
    (dup,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([dup], hashes[2:3], 0, 1)
    pool.cache_full_blocks([b, c, d], [hashes[1], hashes[2], hashes[3]], 0, 3)
    assert c.block_hash is None  # hashes[2] is held by dup
    assert pool.get_cached_block(hashes[3]) is d


def test_cache_full_blocks_rejects_more_blocks_than_hashes():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="cannot cache 2 blocks: request has 2 blocks and 1 hashes"):
        pool.cache_full_blocks(blocks, _hashes(1), 0, 2)
    with pytest.raises(ValueError, match="request has 1 blocks and 2 hashes"):
        pool.cache_full_blocks(blocks[:1], _hashes(2), 0, 2)
