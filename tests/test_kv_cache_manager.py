"""KVCacheManager: slot allocation, prefix-cache lookups, caching after compute, freeing, swap space."""

from __future__ import annotations

import pytest

from vllm_lite.core.kv_cache_manager import KVCacheManager
from vllm_lite.core.request import Request
from vllm_lite.sampling_params import SamplingParams

BS = 4


def _req(rid: str, n: int, start: int = 0, salt: str | None = None, **sp) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(**sp), None, 0.0, cache_salt=salt)


def _admit(m: KVCacheManager, req: Request, num_new: int | None = None):
    hits, num_hit = m.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_new is None else num_new
    blocks = m.allocate_slots(req, n, num_hit, hits)
    assert blocks is not None
    req.num_computed_tokens = num_hit + n
    return hits, num_hit


def test_allocate_slots_rounds_up_to_blocks_and_grows_per_token():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    r = _req("a", 6)
    new = m.allocate_slots(r, 6)
    assert len(new) == 2 and m.num_free_blocks == 7
    r.num_computed_tokens = 6
    r.append_output_token_ids(99)
    assert m.allocate_slots(r, 1) == []  # position 6 fits in block 2
    r.num_computed_tokens = 7
    r.append_output_token_ids(98)
    assert m.allocate_slots(r, 1) == []  # position 7 still fits
    r.num_computed_tokens = 8
    r.append_output_token_ids(97)
    assert len(m.allocate_slots(r, 1)) == 1  # position 8 opens block 3
    assert len(m.get_block_ids("a")) == 3


def test_allocate_slots_returns_none_without_side_effects_when_short():
    m = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    a = _req("a", 8)
    assert m.allocate_slots(a, 8) is not None
    b = _req("b", 8)
    assert m.allocate_slots(b, 8) is None
    assert m.num_free_blocks == 1 and m.get_block_ids("b") == []


def test_prefix_hit_covers_full_blocks_but_never_the_last_token():
    m = KVCacheManager(num_blocks=20, block_size=BS)
    a = _req("a", 12)
    _admit(m, a)
    m.cache_blocks(a, a.num_computed_tokens)
    # Same 12 tokens: 3 full blocks cached, but the last token must be computed -> only 2 hit.
    b = _req("b", 12)
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 8 and [x.block_id for x in hits] == m.get_block_ids("a")[:2]
    # A longer prompt with the same prefix hits all 3.
    c = _req("c", 14)
    assert m.get_computed_blocks(c)[1] == 12


def test_prefix_hit_allocation_shares_blocks_and_counts_refs():
    m = KVCacheManager(num_blocks=20, block_size=BS)
    a = _req("a", 9)
    _admit(m, a)
    m.cache_blocks(a, 9)
    b = _req("b", 10)
    hits, num_hit = _admit(m, b)
    assert num_hit == 8
    shared = m.get_block_ids("a")[:2]
    assert m.get_block_ids("b")[:2] == shared
    assert all(blk.ref_cnt == 2 for blk in hits)
    m.free(a)
    assert all(blk.ref_cnt == 1 for blk in hits)
    m.free(b)
    assert m.num_free_blocks == m.num_total_blocks


def test_hit_on_free_cached_blocks_counts_them_against_free_space():
    m = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    a = _req("a", 8)
    _admit(m, a)
    m.cache_blocks(a, 8)
    m.free(a)
    assert m.num_free_blocks == 3
    # b hits a's 2 free cached blocks and needs 2 more: 4 > 3 usable -> None, hits untouched.
    b = _req("b", 13)
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 8
    assert m.allocate_slots(b, 5, num_hit, hits) is None
    assert all(blk.ref_cnt == 0 for blk in hits) and m.num_free_blocks == 3
    # With 1 more block needed it fits, and the hit blocks are not evicted to make room.
    c = _req("c", 10)
    hits, num_hit = m.get_computed_blocks(c)
    new = m.allocate_slots(c, 2, num_hit, hits)
    assert new is not None and len(new) == 1
    assert m.get_block_ids("c")[:2] == [blk.block_id for blk in hits]
    assert all(blk.block_hash is not None for blk in hits)


def test_cache_salt_separates_prefixes():
    m = KVCacheManager(num_blocks=20, block_size=BS)
    a = _req("a", 9, salt="tenant-1")
    _admit(m, a)
    m.cache_blocks(a, 9)
    assert m.get_computed_blocks(_req("b", 9, salt="tenant-2"))[1] == 0
    assert m.get_computed_blocks(_req("c", 9))[1] == 0
    assert m.get_computed_blocks(_req("d", 9, salt="tenant-1"))[1] == 8


def test_blocks_are_cached_only_once_computed():
    m = KVCacheManager(num_blocks=20, block_size=BS)
    a = _req("a", 12)
    assert m.allocate_slots(a, 12) is not None
    # Allocated but not computed yet: nothing is in the cache.
    assert m.get_computed_blocks(_req("b", 12))[1] == 0
    m.cache_blocks(a, 5)
    assert m.get_computed_blocks(_req("c", 12))[1] == 4


def test_prefix_caching_disabled_finds_nothing_and_counts_nothing():
    m = KVCacheManager(num_blocks=20, block_size=BS, enable_caching=False)
    a = _req("a", 9)
    _admit(m, a)
    m.cache_blocks(a, 9)
    assert m.get_computed_blocks(_req("b", 9)) == ([], 0)
    m.record_prefix_cache_lookup(9, 0)
    assert m.take_prefix_cache_stats() == (0, 0)


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    m = KVCacheManager(num_blocks=20, block_size=BS)
    a = _req("a", 9)
    _admit(m, a)
    m.cache_blocks(a, 9)
    assert m.get_computed_blocks(_req("b", 9, prompt_logprobs=1))[1] == 0


def test_prefix_cache_stats_are_taken_and_reset():
    m = KVCacheManager(num_blocks=20, block_size=BS)
    m.record_prefix_cache_lookup(10, 8)
    m.record_prefix_cache_lookup(5, 0)
    assert m.take_prefix_cache_stats() == (15, 8)
    assert m.take_prefix_cache_stats() == (0, 0)


def test_free_returns_blocks_and_keeps_them_cached():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = _req("a", 9)
    _admit(m, a)
    m.cache_blocks(a, 9)
    m.free(a)
    assert m.num_free_blocks == m.num_total_blocks
    assert m.get_computed_blocks(_req("b", 10))[1] == 8


def test_swap_out_then_in_moves_blocks_through_host_space():
    m = KVCacheManager(num_blocks=6, block_size=BS, num_cpu_blocks=4)
    a = _req("a", 10)
    _admit(m, a)
    dev = m.get_block_ids("a")
    out = m.swap_out(a)
    assert [d for d, _ in out] == dev
    host = [h for _, h in out]
    assert len(set(host)) == 3 and m.num_free_blocks == 5
    assert m.is_swapped("a") and m.get_block_ids("a") == []
    a.append_output_token_ids(7)
    back = m.swap_in(a, 1)
    assert [h for h, _ in back] == host
    assert m.get_block_ids("a")[:3] == [d for _, d in back]
    assert m.host_pool.get_num_free_blocks() == 4 and not m.is_swapped("a")


def test_swap_out_refused_when_host_space_is_full():
    m = KVCacheManager(num_blocks=6, block_size=BS, num_cpu_blocks=1)
    a = _req("a", 10)
    _admit(m, a)
    assert m.swap_out(a) is None
    assert len(m.get_block_ids("a")) == 3


def test_swap_in_refused_when_device_is_short():
    m = KVCacheManager(num_blocks=4, block_size=BS, num_cpu_blocks=4)  # 3 usable
    a = _req("a", 8)
    _admit(m, a)
    m.swap_out(a)
    b = _req("b", 8)
    _admit(m, b)
    assert m.swap_in(a, 1) is None
    assert m.is_swapped("a")
    m.free(a)
    assert m.host_pool.get_num_free_blocks() == 4


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        KVCacheManager(num_blocks=4, block_size=4, num_cpu_blocks=-1)
    m = KVCacheManager(num_blocks=4, block_size=BS)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(_req("a", 3), -1)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        m.allocate_slots(_req("a", 3), 1, 4, [])


# --------------------------------------------------------------- edges found by mutation testing (docs/MUTATION.md)
def test_constructor_bounds_and_messages():
    with pytest.raises(ValueError, match=r"sliding_window must be a positive integer or None, got 0\."):
        KVCacheManager(num_blocks=4, block_size=BS, sliding_window=0)
    with pytest.raises(ValueError, match=r"got 1\.5\."):
        KVCacheManager(num_blocks=4, block_size=BS, sliding_window=1.5)
    m = KVCacheManager(num_blocks=4, block_size=1, sliding_window=1)  # the smallest legal sizes
    assert m.block_size == 1 and m.sliding_window == 1
    # No swap space unless asked for.
    assert KVCacheManager(num_blocks=4, block_size=BS).host_pool.num_usable_blocks == 0


def test_allocate_zero_new_tokens_is_a_no_op():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = _req("a", 4)
    assert m.allocate_slots(a, 0) == [] and m.num_free_blocks == 9
    # A prefix hit with nothing new to compute takes the hit blocks and allocates nothing more.
    _admit(m, b := _req("b", 9))
    m.cache_blocks(b, 9)
    c = _req("c", 9)
    hits, num_hit = m.get_computed_blocks(c)
    assert num_hit == 8
    assert m.allocate_slots(c, 0, num_hit, hits) == []
    assert m.get_blocks("c") == hits


def test_allocate_slots_argument_errors_name_the_problem():
    m = KVCacheManager(num_blocks=20, block_size=BS)
    a = _req("a", 9)
    _admit(m, a)
    m.cache_blocks(a, 9)
    b = _req("b", 9)
    hits, _ = m.get_computed_blocks(b)
    with pytest.raises(ValueError, match=r"num_new_computed_tokens=4 does not match 2 computed blocks of 4 tokens"):
        m.allocate_slots(b, 1, 4, hits)
    m.allocate_slots(b, 1)
    with pytest.raises(ValueError, match=r"request 'b' already holds blocks; prefix hits apply only on admission"):
        m.allocate_slots(b, 1, 8, hits)


def test_block_lists_of_unknown_requests_are_empty():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    assert m.get_blocks("nobody") == [] and m.get_block_ids("nobody") == [] and m.num_blocks_in_use("nobody") == 0
    a = _req("a", 5)
    new = m.allocate_slots(a, 5)
    assert m.get_blocks("a") == new and m.num_blocks_in_use("a") == 2


def _evict_all_cached(m: KVCacheManager) -> None:
    """Take every free block once (evicting its cached hash) and give it back."""
    filler = _req("filler", 1)
    assert m.allocate_slots(filler, m.num_free_blocks * BS) is not None
    m.free(filler)


def test_a_request_freed_and_readmitted_caches_its_blocks_again():
    """Preemption by recompute frees a request and admits it again under the same id."""
    m = KVCacheManager(num_blocks=6, block_size=BS)
    a = _req("a", 9)
    _admit(m, a)
    m.cache_blocks(a, 9)
    m.free(a)
    _evict_all_cached(m)
    a.num_computed_tokens = 0
    _admit(m, a)  # no hit left: a fresh allocation
    m.cache_blocks(a, 9)
    assert m.get_computed_blocks(_req("b", 9))[1] == 8


def test_swap_round_trip_caches_the_new_device_blocks_and_fits_exactly():
    m = KVCacheManager(num_blocks=4, block_size=BS, num_cpu_blocks=2)  # 3 usable device blocks
    a = _req("a", 8)
    _admit(m, a)
    m.cache_blocks(a, 8)
    assert m.swap_out(a) is not None  # exactly as many host blocks as the request holds
    _evict_all_cached(m)
    other = _req("o", 4)
    m.allocate_slots(other, 4)  # leaves exactly 2 free device blocks: enough, nothing to grow
    assert m.swap_in(a, 0) is not None
    m.cache_blocks(a, 8)
    assert m.get_computed_blocks(_req("b", 9))[1] == 8


def test_swap_of_a_request_without_blocks_and_swap_state_errors():
    m = KVCacheManager(num_blocks=4, block_size=BS, num_cpu_blocks=2)
    a = _req("a", 3)
    assert m.swap_out(a) == [] and m.is_swapped("a")
    with pytest.raises(ValueError, match=r"request 'a' is already swapped out"):
        m.swap_out(a)
    with pytest.raises(ValueError, match=r"request 'b' is not swapped out"):
        m.swap_in(_req("b", 3), 1)


def test_window_frees_later_blocks_after_earlier_ones_and_returns_them_all():
    """W=6, blocks of 4: a second step past the window frees the next block behind the first freed ones."""
    m = KVCacheManager(num_blocks=20, block_size=BS, sliding_window=6)
    r = _req("a", 13)
    m.allocate_slots(r, 13)
    r.num_computed_tokens = 13
    r.append_output_token_ids(1)
    m.allocate_slots(r, 1)  # keys from 8 on: blocks 0 and 1 freed
    assert m.num_blocks_in_use("a") == 2
    for t in range(13, 17):
        r.num_computed_tokens = t + 1
        r.append_output_token_ids(1)
        m.allocate_slots(r, 1)
    # At 17 keys come from 12 on: block 2 goes too, and the earlier null entries stop the walk.
    assert m.get_block_ids("a")[:3] == [0, 0, 0] and m.num_blocks_in_use("a") == 2
    assert m.num_free_blocks == m.num_total_blocks - 2
    m.free(r)
    assert m.num_free_blocks == m.num_total_blocks


def test_window_keeps_every_block_a_query_can_still_see_with_one_token_blocks():
    m = KVCacheManager(num_blocks=20, block_size=1, sliding_window=4)
    r = _req("a", 3)
    m.allocate_slots(r, 3)
    r.num_computed_tokens = 3
    r.append_output_token_ids(1)
    m.allocate_slots(r, 1)  # the query at 3 sees keys 0..3: nothing is freed
    assert m.num_blocks_in_use("a") == 4
    r.num_computed_tokens = 4
    r.append_output_token_ids(1)
    m.allocate_slots(r, 1)  # the query at 4 sees keys 1..4: block 0 goes
    assert m.get_block_ids("a")[0] == 0 and m.num_blocks_in_use("a") == 4
