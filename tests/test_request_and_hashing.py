"""The core's Request state and the KV cache building blocks: prefix-cache block hashes, the block, the free list.

Unit tests on real objects (no scheduler, no model). They pin what the scheduler and the KV cache manager rely on:
a new request's starting state, which statuses count as finished, the hash chain and its salts, and the free
list's order and errors.
"""

from __future__ import annotations

import time

import pytest

from vllm_lite.core.kv_cache_utils import (
    ROOT_BLOCK_HASH,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    block_extra_keys,
    cdiv,
    hash_block_tokens,
    update_request_block_hashes,
)
from vllm_lite.core.messages import EngineCoreRequest, FinishReason
from vllm_lite.core.request import Request, RequestStatus
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.sampling_params import SamplingParams


def _request(prompt: list[int], **kw) -> Request:
    return Request("r", prompt, SamplingParams(max_tokens=5), None, 0.0, **kw)


# ---------------------------------------------------------------------- RequestStatus
def test_only_the_four_finished_statuses_count_as_finished_each_with_its_reason():
    finished = {
        RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
        RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
        RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
        RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    }
    for status in RequestStatus:
        assert RequestStatus.is_finished(status) is (status in finished), status
        assert RequestStatus.finish_reason(status) == finished.get(status), status


def test_a_request_reports_the_finish_reason_of_its_status():
    req = _request([1, 2])
    assert not req.is_finished() and req.get_finish_reason() is None
    req.status = RequestStatus.FINISHED_STOPPED  # the lowest finished value: the boundary of is_finished
    assert req.is_finished() and req.get_finish_reason() == FinishReason.STOP
    req.status = RequestStatus.FINISHED_ERROR
    assert req.is_finished() and req.get_finish_reason() == FinishReason.ERROR


# ---------------------------------------------------------------------- Request
def test_a_new_request_starts_waiting_with_nothing_computed_or_generated():
    prompt = [11, 12, 13]
    before = time.monotonic()
    req = Request("r1", prompt, SamplingParams(max_tokens=7), 2, 5.5)
    after = time.monotonic()
    assert (req.request_id, req.prompt_token_ids, req.eos_token_id, req.arrival_time) == ("r1", [11, 12, 13], 2, 5.5)
    assert (req.priority, req.client_index, req.cache_salt, req.tenant_salt) == (0, 0, None, None)
    assert req.status == RequestStatus.WAITING
    assert req.num_prompt_tokens == 3 and req.num_tokens == 3
    assert req.output_token_ids == [] and req.num_output_tokens == 0
    assert req.all_token_ids == [11, 12, 13]
    assert req.num_computed_tokens == 0
    assert req.num_cached_tokens == -1  # "not scheduled yet": the scheduler sets the hit length once
    assert req.stop_reason is None and req.num_preemptions == 0
    assert before <= req.queued_ts <= after and req.scheduled_ts == 0.0
    assert req.max_tokens == 7
    assert req.block_hashes == [] and req.structured_output_request is None


def test_a_request_copies_its_prompt_so_the_callers_list_can_change():
    prompt = [1, 2, 3]
    req = _request(prompt)
    prompt.append(4)
    req.append_output_token_ids(9)
    assert req.prompt_token_ids == [1, 2, 3]
    assert prompt == [1, 2, 3, 4]
    assert req.all_token_ids == [1, 2, 3, 9]  # the prompt list itself is not extended by outputs


def test_appended_outputs_extend_outputs_and_all_tokens_one_or_many_at_a_time():
    req = _request([1, 2])
    req.append_output_token_ids(5)
    req.append_output_token_ids([6, 7])
    assert req.output_token_ids == [5, 6, 7]
    assert req.all_token_ids == [1, 2, 5, 6, 7]
    assert (req.num_tokens, req.num_output_tokens, req.num_prompt_tokens) == (5, 3, 2)
    assert req.prompt_token_ids == [1, 2]


def test_from_engine_core_request_keeps_every_field_and_takes_the_tenant_salt_from_the_core():
    sp = SamplingParams(max_tokens=3)
    ecr = EngineCoreRequest("id9", [4, 5], sp, 99, 12.5, priority=-2, client_index=3, cache_salt="cs")
    req = Request.from_engine_core_request(ecr, tenant_salt=b"tenant-a")
    assert (req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_id) == ("id9", [4, 5], sp, 99)
    assert (req.arrival_time, req.priority, req.client_index) == (12.5, -2, 3)
    assert (req.cache_salt, req.tenant_salt) == ("cs", b"tenant-a")
    assert req.max_tokens == 3
    assert Request.from_engine_core_request(ecr).tenant_salt is None
    assert req.pooling_params is None


def test_a_pooling_request_from_the_wire_keeps_its_pooling_params_and_samples_nothing():
    pp = PoolingParams(normalize=True)
    req = Request.from_engine_core_request(EngineCoreRequest("p", [1, 2], None, None, 0.0, pooling_params=pp))
    assert req.pooling_params is pp
    assert req.sampling_params.max_tokens == 1 and req.sampling_params.temperature == 0.0
    with pytest.raises(ValueError, match=r"^request 'x': needs sampling_params or pooling_params\.$"):
        Request("x", [1], None, None, 0.0)


def test_repr_names_id_status_and_progress():
    req = _request([1, 2, 3])
    req.append_output_token_ids(4)
    req.num_computed_tokens = 3
    assert repr(req) == "Request('r', status=WAITING, prompt=3, out=1, computed=3)"


# ---------------------------------------------------------------------- block hashes
# Pinned digests: a block's hash is a pure function of (parent, tokens, extra keys), equal in every process and
# run (frontends and restarts share the cache); changing the encoding must be deliberate (bump the root seed).
_ROOT_HEX = "0800bcd167436cd75ae119b5b8871af2fef266e7e88bf561e1058db2912f7336"
_FIRST_BLOCK_HEX = "f198fa4927ee8785f6d1043ac002e5e23f119768ad0d8a3f8065492278b8bca8"
_SALTED_HEX = "4255eaa5daa342ae3fb760ad24c1e1e1beac6357787e8074a718c284636a6823"


def test_block_hash_digests_are_pinned():
    assert ROOT_BLOCK_HASH.hex() == _ROOT_HEX
    assert hash_block_tokens(None, [1, 2, 3, 4]).hex() == _FIRST_BLOCK_HEX
    assert hash_block_tokens(b"\x01" * 32, (5, 6), ("tenant", b"t", "salt", "s")).hex() == _SALTED_HEX


def test_first_block_chains_from_the_root_seed_and_no_extra_keys_equals_empty_keys():
    tokens = [1, 2, 3, 4]
    assert hash_block_tokens(None, tokens) == hash_block_tokens(ROOT_BLOCK_HASH, tokens)
    assert hash_block_tokens(None, tokens, None) == hash_block_tokens(None, tokens, ())
    assert hash_block_tokens(None, tokens, ("salt", "x")) != hash_block_tokens(None, tokens)
    assert hash_block_tokens(None, tokens) != hash_block_tokens(hash_block_tokens(None, tokens), tokens)
    assert len(hash_block_tokens(None, tokens)) == 32


def test_salts_enter_only_the_first_block_in_separate_slots():
    plain = _request([1] * 8)
    assert block_extra_keys(plain, 0) is None
    salted = _request([1] * 8, cache_salt="s", tenant_salt=b"t")
    assert block_extra_keys(salted, 0) == ("tenant", b"t", "salt", "s")
    assert block_extra_keys(salted, 1) is None and block_extra_keys(salted, 2) is None
    assert block_extra_keys(_request([1], cache_salt="s"), 0) == ("salt", "s")
    assert block_extra_keys(_request([1], tenant_salt=b"t"), 0) == ("tenant", b"t")
    # A cache_salt can never pose as a tenant salt: the slot names differ.
    assert block_extra_keys(_request([1], cache_salt="t"), 0) != block_extra_keys(_request([1], tenant_salt=b"t"), 0)


def test_request_block_hashes_cover_full_blocks_only_chained_and_salted():
    req = _request(list(range(10)), cache_salt="s")
    hashes = update_request_block_hashes(req, 4)
    assert hashes is req.block_hashes and len(hashes) == 2  # tokens 8, 9 fill no block yet
    first = hash_block_tokens(None, [0, 1, 2, 3], ("salt", "s"))
    assert hashes == [first, hash_block_tokens(first, [4, 5, 6, 7])]
    # Growing by outputs hashes only the newly full block, chained on the last one; earlier ones are kept.
    req.append_output_token_ids([10, 11])
    kept = list(hashes)
    assert update_request_block_hashes(req, 4)[:2] == kept
    assert req.block_hashes[2] == hash_block_tokens(kept[1], [8, 9, 10, 11])
    assert update_request_block_hashes(req, 4) == req.block_hashes and len(req.block_hashes) == 3
    # A request without salts chains from an unsalted first block.
    assert update_request_block_hashes(_request(list(range(4))), 4) == [hash_block_tokens(None, [0, 1, 2, 3])]


def test_hash_chain_only_extends_what_is_already_there():
    req = _request(list(range(8)))
    req.block_hashes.append(b"p" * 32)  # a first hash already computed (here: a stand-in)
    update_request_block_hashes(req, 4)
    assert req.block_hashes == [b"p" * 32, hash_block_tokens(b"p" * 32, [4, 5, 6, 7])]


# ---------------------------------------------------------------------- block and free list
def test_a_new_block_is_free_unhashed_unlinked_and_not_null():
    b = KVCacheBlock(7)
    assert (b.block_id, b.ref_cnt, b.block_hash, b.is_null) == (7, 0, None, False)
    assert b.prev_free_block is None and b.next_free_block is None
    assert repr(b) == "KVCacheBlock(id=7, ref_cnt=0, hash=None)"
    b.block_hash = bytes.fromhex("abcdef0123456789ff")
    b.ref_cnt = 2
    assert repr(b) == "KVCacheBlock(id=7, ref_cnt=2, hash=abcdef01)"


def _ids(q: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in q.get_all_free_blocks()]


def test_free_list_pops_in_append_order_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert len(q) == 5 and q.num_free_blocks == 5 and _ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert _ids(q) == [0, 1, 3, 4] and len(q) == 4
    assert not q.contains(blocks[2]) and q.contains(blocks[3]) and q.contains(blocks[0]) and q.contains(blocks[4])
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    q.append(blocks[2])
    assert _ids(q) == [0, 1, 3, 4, 2]
    assert q.popleft() is blocks[0]
    assert [b.block_id for b in q.popleft_n(2)] == [1, 3]
    assert _ids(q) == [4, 2] and len(q) == 2
    assert q.popleft_n(0) == []
    assert [b.block_id for b in q.popleft_n(2)] == [4, 2]
    assert len(q) == 0 and _ids(q) == []


def test_free_list_errors_name_the_block_or_the_shortfall():
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match="^asked for 3 free blocks, only 2 are free$"):
        q.popleft_n(3)
    assert len(q) == 2  # a refused popleft_n takes nothing
    with pytest.raises(ValueError, match="^block 1 is already in the free list$"):
        q.append(blocks[1])
    q.popleft_n(2)
    with pytest.raises(ValueError, match="^no free blocks left to pop$"):
        q.popleft()
    with pytest.raises(ValueError, match="^block 0 is not in the free list$"):
        q.remove(blocks[0])
    assert len(q) == 0


def test_cdiv_rounds_up():
    assert [cdiv(a, 4) for a in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
