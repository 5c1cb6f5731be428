"""Causality of the bf16 prefill attention path (csrc/attention_prefill_bf16.h) for non-finite values in the cache.
A row at position p gives probability 0 to keys past p, but its values pass may still read them: the partner of
its last key in a bf16 key pair (key p + 1) and the keys its register block's last row sees. 0 * finite adds a zero
that leaves the row's bits alone; 0 * inf or 0 * NaN is NaN, so a chunk holding a non-finite value runs each row
over its own keys only. Each prompt token's output must stay the decode path's bits at its position (the decode
path never reads past a row's keys), and a later token's non-finite value must not reach an earlier token's output.
Skipped where the build does not target AVX512-BF16."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_lite.testing.attention_oracle import random_attention_case as make_case
from vllm_lite.testing.cpu_bf16_attention import avx512_native_backend, requires_avx512_bf16
from vllm_lite.testing.paged import as_decodes
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend

pytestmark = requires_avx512_bf16


@pytest.fixture(scope="module")
def backend() -> CpuNativeBackend:
    return avx512_native_backend()


def put_value(cache, md, bs: int, pos: int, kv_head: int, value: float, channel: int = 0) -> None:
    """The value of request 0's key at position pos, KV head kv_head, one channel."""
    blk = int(md.block_table[0, pos // bs])
    cache[1, blk, pos % bs, kv_head, channel] = value


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (NaN included: both paths round a NaN the same way)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def check(backend, query, cache, md, bs: int, first_bad: int, head_size: int) -> torch.Tensor:
    """Prefill == decode bit for bit; every token before first_bad (request 0's token index) all finite."""
    scale = 1.0 / math.sqrt(head_size)
    decode = backend.forward(query, cache, as_decodes(md, bs), scale)
    assert torch.isfinite(decode[:first_bad].float()).all()
    prefill = backend.forward(query, cache, md, scale)
    bad = (~torch.isfinite(prefill[:first_bad].float())).nonzero().tolist()
    assert not bad, f"non-finite outputs at (token, head, channel) {bad[:5]} before the non-finite value's position"
    assert same_bits(prefill, decode)
    return prefill


# Position 5: the partner of key 4 in pair (4, 5) (row 4 reads it with probability 0). Position 6: pair (6, 7),
# which rows 4 and 5 read with probability 0 in a register block whose last row is 6 or 7 (head sizes up to 128).
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("pos", [5, 6])
@pytest.mark.parametrize("head_size", [32, 64, 128, 256])
def test_a_later_tokens_non_finite_value_stays_out_of_earlier_rows(backend, head_size, pos, value):
    bs = 16
    query, cache, md = make_case([20], [20], 1, 1, head_size, bs, torch.bfloat16, seed=1)
    put_value(cache, md, bs, pos, 0, value)
    out = check(backend, query, cache, md, bs, pos, head_size)
    # From pos on the value is seen with a positive probability: channel 0 is non-finite, the others are not.
    assert not torch.isfinite(out[pos:, :, 0].float()).any()
    assert torch.isfinite(out[:, :, 1:].float()).all()


@pytest.mark.parametrize("group", [2, 3, 4])
def test_gqa_rows_of_one_token_and_other_kv_heads(backend, group):
    """GQA: a register block holds heads of one or two tokens; the non-finite value of KV head 1 stays out of
    KV head 0's rows entirely and out of KV head 1's rows before its position."""
    bs, kv_heads, d, pos = 16, 2, 64, 9
    query, cache, md = make_case([33], [33], kv_heads * group, kv_heads, d, bs, torch.bfloat16, seed=2)
    put_value(cache, md, bs, pos, 1, math.inf, channel=7)
    out = check(backend, query, cache, md, bs, pos, d)
    assert torch.isfinite(out[:, :group].float()).all(), "KV head 1's value reached KV head 0's query heads"
    assert not torch.isfinite(out[pos:, group:, 7].float()).any()


@pytest.mark.parametrize("head_size", [64, 128])
def test_non_finite_in_a_later_chunk_and_in_the_context(backend, head_size):
    """A prompt of 300 tokens after 250 cached ones (its keys span chunks 0-2 of 256 keys, several items): a NaN
    at position 517 (chunk 2, odd, partner of key 516) reaches no token before it; then a NaN in the cached
    context (position 100, seen by every token) makes every row's channel NaN on both paths, with the same bits."""
    bs, ctx, n = 16, 250, 300
    query, cache, md = make_case([n, 7], [ctx + n, 40], 4, 2, head_size, bs, torch.bfloat16, seed=3)
    put_value(cache, md, bs, 517, 0, math.nan, channel=3)
    out = check(backend, query, cache, md, bs, 517 - ctx, head_size)
    assert torch.isnan(out[517 - ctx : n, :2, 3].float()).all()
    put_value(cache, md, bs, 100, 1, math.nan, channel=5)
    out = check(backend, query, cache, md, bs, 0, head_size)
    assert torch.isnan(out[:n, 2:, 5].float()).all()
